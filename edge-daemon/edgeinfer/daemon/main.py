"""``edge-daemon``: serve one model over HTTP from an edge PoP.

Settings come from ``--config FILE`` (its ``[daemon]`` table), then ``EDGEINFER_*`` environment
variables, then flags. Start-up problems (bad config, port in use, unloadable model) end the
process with one ``edge-daemon: error: ...`` line and a non-zero status: 2 for configuration,
1 for the rest. SIGTERM/SIGINT drain in-flight requests (up to ``drain_timeout_s``) first.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any, NoReturn

import click
import uvloop
from aiohttp import web

from edgeinfer.daemon.app import DaemonError, build_app
from edgeinfer.daemon.config import DaemonConfig, load_daemon_config
from edgeinfer.daemon.state import STATE_KEY
from edgeinfer.shared.errors import ConfigError

log = logging.getLogger("edgeinfer.daemon")

EXIT_RUNTIME = 1
EXIT_CONFIG = 2

_SHUTDOWN_GRACE_S = 2.0


async def serve(config: DaemonConfig) -> None:
    """Listen, load the model, serve until SIGTERM/SIGINT, then drain and stop."""
    app = build_app(config)
    # handler_cancellation: a dropped connection cancels its handler, which aborts the request
    # even while it waits in the queue or prefills (no write is there to fail). The short
    # shutdown_timeout applies after our own drain, which already waited drain_timeout_s.
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=_SHUTDOWN_GRACE_S)
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.host, config.port)
        try:
            await site.start()
        except OSError as exc:
            raise DaemonError(
                f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}"
            ) from exc
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        state = app[STATE_KEY]
        log.info("listening on http://%s:%d (role %s)", config.host, config.port, config.role)
        await _first_of(state.settled, stop)
        if state.load_error is not None:
            raise DaemonError(f"cannot load model {config.model_name!r}: {state.load_error}")
        await stop.wait()
        state.drain()
        if state.plane is not None:
            await state.plane.set_draining(True)
        log.info("stopping: waiting for %d in-flight requests", state.in_flight)
        if not await state.wait_idle(config.drain_timeout_s):
            log.warning("drain timeout: aborting %d requests", state.in_flight)
    finally:
        await runner.cleanup()


async def _first_of(*events: asyncio.Event) -> None:
    waiters = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()


def _fail(message: str, code: int) -> NoReturn:
    click.echo(f"edge-daemon: error: {message}", err=True)
    sys.exit(code)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="TOML file; settings under [daemon].",
)
@click.option("--model", help='Checkpoint directory, "tiny", or omit for the built-in model.')
@click.option("--dtype", help="auto | float32 | bfloat16 | float16")
@click.option("--role", help="both | prefill | decode")
@click.option("--host", help="HTTP bind address.")
@click.option("--port", type=int, help="HTTP port.")
@click.option("--kv-port", type=int, help="ZeroMQ port for KV transfer.")
@click.option(
    "--prefill-peer",
    "prefill_peers",
    multiple=True,
    help="ZeroMQ endpoint of a prefill daemon (repeatable).",
)
@click.option(
    "--local-prefill-threshold",
    type=int,
    help="Prompts shorter than this (tokens) are prefilled locally.",
)
@click.option("--pop", help="Name of this point of presence.")
@click.option("--log-level", help="debug | info | warning | error")
def main(config_file: Path | None, **flags: Any) -> None:
    """Serve an LLM over an OpenAI-compatible HTTP API."""
    # click reports an absent repeatable option as (); the loader's "not given" is None.
    flags["prefill_peers"] = flags["prefill_peers"] or None
    try:
        config = load_daemon_config(config_file, env=os.environ, overrides=flags)
    except ConfigError as exc:
        _fail(str(exc), EXIT_CONFIG)
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        uvloop.run(serve(config))
    except DaemonError as exc:
        _fail(str(exc), EXIT_RUNTIME)


if __name__ == "__main__":
    main()
