"""``edge-router``: the anycast HTTP endpoint that places each request on prefill/decode PoPs.

Settings come from ``--config FILE`` (its ``[router]`` table and ``[[pop]]`` list), then
``EDGEINFER_*`` environment variables, then flags. Start-up problems end the process with one
``edge-router: error: ...`` line: status 2 for configuration, 1 for the rest.

Signals follow uvicorn's ``should_exit``/``force_exit`` split: the first SIGTERM or SIGINT
stops accepting connections and lets in-flight streams finish (up to ``shutdown_timeout_s``);
a second one stops waiting. SIGHUP re-reads the PoP list, the log level and the log format
(other changed settings are logged as needing a restart); a bad file is logged and the old list
stays, because a typo must not take a serving router down; the API keys file is re-read too,
by the same rule. Under systemd (``Type=notify``) the router sends READY=1 once it listens,
STOPPING=1 on the first signal, and watchdog pings.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
from pathlib import Path
from typing import NoReturn

import click
import uvloop
from aiohttp import web

from edgeinfer.router import selector
from edgeinfer.router.app import (
    RouterSetup,
    create_app,
    make_runner,
    reload_daemon_key,
    reload_pops,
)
from edgeinfer.router.config import RouterConfig, load_pops, load_router_config
from edgeinfer.router.daemon_key import DaemonKey
from edgeinfer.router.gate import GATE_KEY, check_gate_config
from edgeinfer.shared.errors import ConfigError, EdgeInferError
from edgeinfer.shared.logs import configure_logging
from edgeinfer.shared.reload import LOGGING_KEYS, SettingsReloader
from edgeinfer.shared.sdnotify import Notifier

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


async def serve(setup: RouterSetup, settings: SettingsReloader[RouterConfig] | None = None) -> None:
    """Serve until SIGTERM/SIGINT; ``settings`` re-reads the router's own settings on SIGHUP."""
    config = setup.config
    app = create_app(setup)
    notifier = Notifier.from_env()
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
        loop.add_signal_handler(signal.SIGHUP, _reload, app, settings)
        log.info(
            "listening on http://%s (PoP %s, %d PoPs)", config.listen, config.here, len(setup.pops)
        )
        # What start-up built (modules, the PoP table, the GeoIP reader) lives as long as the
        # process: out of the collector's sight, a full collection no longer walks it (~25 ms
        # here, a pause every request in flight would add to its latency).
        gc.freeze()
        async with notifier.watchdog():
            notifier.ready(f"routing on {config.listen} (PoP {config.here})")
            await shutdown.should_exit.wait()
            notifier.stopping("letting in-flight streams finish")
    finally:
        # Stops listening, waits for running handlers (streams) up to shutdown_timeout_s, then
        # runs cleanup_ctx: discovery, heartbeats and the upstream pool go last.
        await runner.cleanup()
        notifier.close()


def _reload(app: web.Application, settings: SettingsReloader[RouterConfig] | None) -> None:
    if settings is not None:
        settings.reload()
    gate = app.get(GATE_KEY)
    if gate is not None:
        gate.reload()  # API keys: a removed key is refused at once, its streams finish
    reload_daemon_key(app)
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
@click.option("--log-format", help="text | kv | json (one line per event)")
def main(
    config_file: Path, listen: str | None, log_level: str | None, log_format: str | None
) -> None:
    """Place OpenAI API requests on the best prefill and decode PoPs and proxy them."""
    flags = {"listen": listen, "log_level": log_level, "log_format": log_format}

    def load() -> RouterConfig:
        return load_router_config(config_file, env=os.environ, overrides=flags)

    try:
        config = load()
        setup = RouterSetup(
            config=config,
            pops=load_pops(config_file, config.here),
            admin_token=config.read_admin_token(),
            config_path=config_file,
        )
        check_gate_config(config)
        DaemonKey(config.daemon_api_key_file)  # an unreadable key file is a config error
    except ConfigError as exc:
        _fail(str(exc), EXIT_CONFIG)
    configure_logging(config.log_level, config.log_format)
    if setup.admin_token is None:
        log.warning("no admin_token_file: the admin API (drain, status) refuses every call")
    # Placement's compiled passes: from the disk cache, or compiled once (seconds) before the
    # router listens rather than inside its first request.
    selector.warm()
    try:
        # The PoP list is reloaded separately (reload_pops); these are the [router] settings.
        uvloop.run(serve(setup, SettingsReloader(config, load, LOGGING_KEYS)))
    except asyncio.CancelledError:
        sys.exit(EXIT_RUNTIME)  # a second signal cut the graceful shutdown short
    except EdgeInferError as exc:
        _fail(str(exc), EXIT_RUNTIME)


if __name__ == "__main__":
    main()
