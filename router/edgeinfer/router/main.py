"""``edge-router``: the anycast HTTP endpoint that places each request on prefill/decode PoPs.

Settings come from ``--config FILE`` (its ``[router]`` table and ``[[pop]]`` list), then
``EDGEINFER_*`` environment variables, then flags. Start-up problems end the process with one
``edge-router: error: ...`` line: status 2 for configuration, 1 for the rest.

Signals follow uvicorn's ``should_exit``/``force_exit`` split: the first SIGTERM or SIGINT
stops accepting connections and lets in-flight streams finish (up to ``shutdown_timeout_s``);
a second one stops waiting. SIGHUP re-reads the PoP list; a bad file is logged and the old list
stays, because a typo must not take a serving router down.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from pathlib import Path
from typing import NoReturn

import click
import uvloop
from aiohttp import web

from edgeinfer.router.app import RouterSetup, create_app, make_runner, reload_pops
from edgeinfer.router.config import load_pops, load_router_config
from edgeinfer.shared.errors import ConfigError, EdgeInferError

log = logging.getLogger("edgeinfer.router")

EXIT_RUNTIME = 1
EXIT_CONFIG = 2


class _Shutdown:
    """uvicorn's two-step exit: the first signal asks nicely, the second stops waiting."""

    def __init__(self, main_task: asyncio.Task[None]) -> None:
        self.should_exit = asyncio.Event()
        self._main_task = main_task

    def handle(self, sig: signal.Signals) -> None:
        if self.should_exit.is_set():
            log.warning("%s again: not waiting for streams any longer", sig.name)
            self._main_task.cancel()
            return
        log.info("%s: stopping, letting in-flight streams finish", sig.name)
        self.should_exit.set()


async def serve(setup: RouterSetup) -> None:
    config = setup.config
    app = create_app(setup)
    runner = make_runner(app, config)
    await runner.setup()
    try:
        host, port = config.listen_address()
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as exc:
            raise EdgeInferError(
                f"cannot listen on {config.listen}: {exc.strerror or exc}"
            ) from exc
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        if task is None:  # pragma: no cover - serve() always runs as a task under uvloop.run
            raise RuntimeError("serve() must run in a task")
        shutdown = _Shutdown(task)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, shutdown.handle, sig)
        loop.add_signal_handler(signal.SIGHUP, _reload, app)
        log.info(
            "listening on http://%s (PoP %s, %d PoPs)", config.listen, config.here, len(setup.pops)
        )
        await shutdown.should_exit.wait()
    finally:
        # Stops listening, waits for running handlers (streams) up to shutdown_timeout_s, then
        # runs cleanup_ctx: discovery, heartbeats and the upstream pool go last.
        await runner.cleanup()


def _reload(app: web.Application) -> None:
    try:
        reload_pops(app)
    except EdgeInferError as exc:
        log.error("SIGHUP: keeping the current PoP list: %s", exc)


def _fail(message: str, code: int) -> NoReturn:
    click.echo(f"edge-router: error: {message}", err=True)
    sys.exit(code)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--config",
    "config_file",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="TOML file: [router] settings and the [[pop]] list.",
)
@click.option("--listen", help="HOST:PORT to serve on.")
@click.option("--log-level", help="debug | info | warning | error")
def main(config_file: Path, listen: str | None, log_level: str | None) -> None:
    """Place OpenAI API requests on the best prefill and decode PoPs and proxy them."""
    try:
        config = load_router_config(
            config_file, env=os.environ, overrides={"listen": listen, "log_level": log_level}
        )
        setup = RouterSetup(
            config=config,
            pops=load_pops(config_file, config.here),
            admin_token=config.read_admin_token(),
            config_path=config_file,
        )
    except ConfigError as exc:
        _fail(str(exc), EXIT_CONFIG)
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if setup.admin_token is None:
        log.warning("no admin_token_file: the admin API (drain, status) refuses every call")
    try:
        uvloop.run(serve(setup))
    except asyncio.CancelledError:
        sys.exit(EXIT_RUNTIME)  # a second signal cut the graceful shutdown short
    except EdgeInferError as exc:
        _fail(str(exc), EXIT_RUNTIME)


if __name__ == "__main__":
    main()
