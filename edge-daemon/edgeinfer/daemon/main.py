"""``edge-daemon``: serve one model over HTTP from an edge PoP.

Settings come from ``--config FILE`` (its ``[daemon]`` table), then ``EDGEINFER_*`` environment
variables, then flags. Start-up problems (bad config, port in use, unloadable model) end the
process with one ``edge-daemon: error: ...`` line and a non-zero status: 2 for configuration,
1 for the rest. SIGTERM/SIGINT drain in-flight requests (up to ``drain_timeout_s``, then abort
the rest with an error) and exit 0; SIGHUP re-reads the settings and applies the log level and
format (the others need a restart and are named in the log). Under systemd (``Type=notify``) the
daemon reports loading progress, READY=1 once the model serves, STOPPING=1, and watchdog pings.

Every port is bound before the model loads; port 0 is any free port, and the log line
"listening on ...", ``/v1/state`` and the heartbeats give the ports bound. A stop while the
model loads ends the process promptly with status 0 (``lifecycle.exit_now`` says how), as does
one during the imports, before anything has started.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

import click
import uvloop

from edgeinfer.shared.errors import ConfigError
from edgeinfer.shared.logs import configure_logging
from edgeinfer.shared.reload import LOGGING_KEYS, SettingsReloader
from edgeinfer.shared.sdnotify import Notifier

# The daemon's own modules load torch (seconds): they are imported inside the functions, after
# main() has made a stop signal end the process cleanly.
if TYPE_CHECKING:
    from edgeinfer.daemon.config import DaemonConfig

log = logging.getLogger("edgeinfer.daemon")

EXIT_RUNTIME = 1
EXIT_CONFIG = 2

_SHUTDOWN_GRACE_S = 2.0
_ENGINE_CHECK_S = 1.0
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


async def serve(config: DaemonConfig, reload: Callable[[], DaemonConfig] | None = None) -> bool:
    """Listen, load the model, serve until SIGTERM/SIGINT, then drain and stop.

    Returns False when the stop came before the model had loaded: the load may still run in
    its thread (:meth:`AsyncEngine.abandoned_builds`). ``reload`` re-reads the settings on
    SIGHUP; without it SIGHUP keeps its default action.
    """
    from aiohttp import web

    from edgeinfer.daemon.api.access_log import AccessLog
    from edgeinfer.daemon.app import DaemonError, build_app
    from edgeinfer.daemon.lifecycle import drain, first_of, wait_loaded
    from edgeinfer.daemon.listeners import ListenError, Listeners
    from edgeinfer.daemon.state import STATE_KEY, Phase

    # Before anything starts, so that from here on a stop only sets the event each step checks.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in _STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    try:
        listeners = Listeners.bind(config)
    except ListenError as exc:
        raise DaemonError(str(exc)) from exc
    requested, config = config, listeners.resolve(config)
    app = build_app(config, listeners=listeners)
    notifier = Notifier.from_env()
    # handler_cancellation: a dropped connection cancels its handler, which aborts the request
    # even while it waits in the queue or prefills (no write is there to fail). The short
    # shutdown_timeout applies after our own drain, which already waited drain_timeout_s.
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        shutdown_timeout=_SHUTDOWN_GRACE_S,
        access_log_class=AccessLog,
    )
    await runner.setup()
    try:
        await web.SockSite(runner, listeners.http).start()
        if reload is not None:
            # Against the settings as given: a port given as 0 is still 0 when re-read.
            reloader = SettingsReloader(requested, reload, LOGGING_KEYS)
            loop.add_signal_handler(signal.SIGHUP, reloader.reload)
        state = app[STATE_KEY]
        kv = f"KV transfer on {config.kv_endpoint}, " if listeners.kv is not None else ""
        log.info(
            "listening on http://%s:%d (role %s); %sheartbeats on %s",
            config.host,
            config.port,
            config.role,
            kv,
            config.heartbeat_endpoint,
        )
        if config.api_key is None:
            log.warning(
                "no api_key: anyone who reaches port %d may use this daemon; set api_key "
                "(EDGEINFER_API_KEY, --api-key) to the routers' daemon key unless only they can",
                config.port,
            )
        # The engine thread dying leaves the loop turning: stop the pings so systemd restarts us.
        async with notifier.watchdog(healthy=lambda: state.phase is not Phase.FAILED):
            await wait_loaded(state, stop, notifier, config)
            if not state.settled.is_set():
                log.info("stopping: the model %s had not finished loading", config.model_name)
                notifier.stopping("stopped while loading the model")
                return False
            if state.load_error is not None:
                raise DaemonError(f"cannot load model {config.model_name!r}: {state.load_error}")
            # Everything alive now (modules, the model) lives as long as the process: out of
            # the collector's sight, a full collection no longer walks it (tens of ms, an ITL
            # spike on every stream, each time one runs).
            gc.freeze()
            where = f"{config.host}:{config.port}"
            notifier.ready(f"serving {config.model_name} on {where} (role {config.role})")
            # A dead engine (a crashed step, a dead worker rank) ends the daemon non-zero
            # instead of leaving it up with /health at 503.
            while not stop.is_set() and state.phase is not Phase.FAILED:
                await first_of(stop, timeout=_ENGINE_CHECK_S)
            if not stop.is_set():
                error = state.engine.fatal_error if state.engine is not None else None
                raise DaemonError(f"the engine failed: {error}")
            await drain(state, config, notifier)
    finally:
        await runner.cleanup()
        listeners.close()
        notifier.close()
    return True


def _fail(message: str, code: int) -> NoReturn:
    click.echo(f"edge-daemon: error: {message}", err=True)
    sys.exit(code)


def _exit_at_once(signum: int, frame: FrameType | None) -> NoReturn:
    raise SystemExit(0)


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
@click.option("--port", type=int, help="HTTP port (0: any free port, logged).")
@click.option("--kv-port", type=int, help="ZeroMQ port for KV transfer (0: any free port).")
@click.option(
    "--heartbeat-port", type=int, help="ZeroMQ port routers read heartbeats from (0: any free)."
)
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
@click.option("--tensor-parallel", type=int, help="Ranks each layer is split across.")
@click.option("--pipeline-parallel", type=int, help="Pipeline stages (contiguous layers).")
@click.option("--pop", help="Name of this point of presence.")
@click.option(
    "--api-key",
    help="Require 'Authorization: Bearer KEY' on /v1/* (the routers' daemon key); "
    "EDGEINFER_API_KEY keeps it out of the process list.",
)
@click.option(
    "--tool-call-parser",
    help="hermes | llama3_json | mistral (default: the format the chat template shows).",
)
@click.option("--log-level", help="debug | info | warning | error")
@click.option("--log-format", help="text | kv | json (one line per event)")
def main(config_file: Path | None, **flags: Any) -> None:
    """Serve an LLM over an OpenAI-compatible HTTP API."""
    # Until serve() takes the stop signals over, one ends the process at once, with status 0:
    # nothing has started yet that would need stopping (the imports take seconds).
    previous = {sig: signal.signal(sig, _exit_at_once) for sig in _STOP_SIGNALS}
    try:
        _run(config_file, flags)
    finally:
        for sig, handler in previous.items():
            if handler is not None:  # None: not set from Python, nothing to put back
                signal.signal(sig, handler)


def _run(config_file: Path | None, flags: dict[str, Any]) -> None:
    from edgeinfer.daemon.app import DaemonError
    from edgeinfer.daemon.config import load_daemon_config
    from edgeinfer.daemon.engine.async_engine import AsyncEngine
    from edgeinfer.daemon.lifecycle import exit_now

    # click reports an absent repeatable option as (); the loader's "not given" is None.
    flags["prefill_peers"] = flags["prefill_peers"] or None

    def load() -> DaemonConfig:
        return load_daemon_config(config_file, env=os.environ, overrides=flags)

    try:
        config = load()
    except ConfigError as exc:
        _fail(str(exc), EXIT_CONFIG)
    configure_logging(config.log_level, config.log_format)
    try:
        loaded = uvloop.run(serve(config, load))
    except DaemonError as exc:
        _fail(str(exc), EXIT_RUNTIME)
    if not loaded and AsyncEngine.abandoned_builds():
        exit_now(0)


if __name__ == "__main__":
    main()
