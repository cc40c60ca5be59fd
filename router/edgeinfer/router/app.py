"""The router's aiohttp application: the OpenAI API, ``/health``, and the admin API.

Everything with a lifetime (the pooled upstream ``ClientSession``, the heartbeat listener,
discovery and RTT probing) starts and stops in one ``cleanup_ctx`` generator, so it shuts down
in reverse order after aiohttp has let in-flight streams finish.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web

from edgeinfer.router.admin import create_admin_app
from edgeinfer.router.config import RouterConfig, load_pops
from edgeinfer.router.discovery import Discovery
from edgeinfer.router.geo import ClientLocator, GeoPoint
from edgeinfer.router.heartbeat_listener import HeartbeatListener
from edgeinfer.router.network import NetworkModel, RttProber
from edgeinfer.router.openai_api import error_response
from edgeinfer.router.pop_registry import PopConfig, PopRegistry
from edgeinfer.router.proxy import PROXY_KEY, Proxy
from edgeinfer.shared.logs import ACCESS_LOG_FORMAT
from edgeinfer.shared.tasks import cancel_and_wait

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterSetup:
    """What the app is built from; ``config_path`` is re-read for the PoP list on reload."""

    config: RouterConfig
    pops: tuple[PopConfig, ...]
    admin_token: str | None
    config_path: Path | None = None


SETUP_KEY = web.AppKey("setup", RouterSetup)
REGISTRY_KEY = web.AppKey("registry", PopRegistry)
DISCOVERY_KEY = web.AppKey("discovery", Discovery)


def create_app(setup: RouterSetup) -> web.Application:
    config = setup.config
    app = web.Application()
    app[SETUP_KEY] = setup
    app[REGISTRY_KEY] = PopRegistry(setup.pops, config.here, config.heartbeat_interval_s)
    app.cleanup_ctx.append(_services)
    app.router.add_post("/v1/completions", _forward)
    app.router.add_post("/v1/chat/completions", _forward)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.add_subapp("/admin", create_admin_app(setup.admin_token))
    return app


def make_runner(app: web.Application, config: RouterConfig) -> web.AppRunner:
    """The runner to serve ``app`` with; tests use the same settings.

    ``handler_cancellation`` makes a client disconnect cancel its handler at once, which is
    what closes the upstream connection, so the daemon stops generating for nobody even while
    it is silent (prefilling) and nothing would otherwise be written to the gone client.
    """
    return web.AppRunner(
        app,
        handler_cancellation=True,
        shutdown_timeout=config.shutdown_timeout_s,
        access_log_format=ACCESS_LOG_FORMAT,
    )


async def _services(app: web.Application) -> AsyncIterator[None]:
    setup, registry = app[SETUP_KEY], app[REGISTRY_KEY]
    config = setup.config
    connector = aiohttp.TCPConnector(limit=config.pool_limit, limit_per_host=0)
    session = aiohttp.ClientSession(
        connector=connector,
        # A daemon's cookies must not be replayed to it on other clients' requests.
        cookie_jar=aiohttp.DummyCookieJar(),
        # Bytes pass through as the daemon encoded them; timeouts are per upstream read.
        auto_decompress=False,
        timeout=aiohttp.ClientTimeout(
            total=None, sock_connect=config.connect_timeout_s, sock_read=config.read_timeout_s
        ),
    )
    here = next(p for p in setup.pops if p.name == config.here)
    locator = ClientLocator(
        config.geoip_db, config.trusted_proxies, fallback=GeoPoint(here.lat, here.lon)
    )
    listener = HeartbeatListener(registry, config.heartbeat_interval_s)
    discovery = Discovery(listener, session, config.discovery_interval_s)
    prober = RttProber(registry, config.rtt_probe_interval_s)
    app[PROXY_KEY] = Proxy(
        config,
        registry,
        locator,
        NetworkModel(catchment_km=config.catchment_km),
        session,
        random.Random(),
    )
    app[DISCOVERY_KEY] = discovery
    await listener.start()
    await prober.start()
    discovery.sync(setup.pops)
    discovery_task = asyncio.create_task(discovery.run(), name="discovery")
    try:
        yield
    finally:
        await cancel_and_wait(discovery_task)
        await prober.stop()
        await listener.stop()
        await session.close()
        locator.close()


def reload_pops(app: web.Application) -> None:
    """SIGHUP: re-read the PoP list and adopt it; running streams are untouched."""
    setup = app[SETUP_KEY]
    if setup.config_path is None:
        log.warning("SIGHUP ignored: the router was started without --config")
        return
    pops = load_pops(setup.config_path, setup.config.here)
    app[REGISTRY_KEY].replace_pops(pops)
    app[DISCOVERY_KEY].sync(pops)
    log.info("reloaded %d PoPs from %s", len(pops), setup.config_path)


async def _forward(request: web.Request) -> web.StreamResponse:
    return await request.app[PROXY_KEY].forward(request)


async def models(request: web.Request) -> web.StreamResponse:
    """Every model some available daemon serves: what a request here can be placed for."""
    views = request.app[REGISTRY_KEY].snapshot(time.monotonic())
    names = sorted({v.model for v in views if v.available and v.model and v.role != "prefill"})
    data = [{"id": n, "object": "model", "created": 0, "owned_by": "edgeinfer"} for n in names]
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.StreamResponse:
    """200 while at least one decode-capable daemon is placeable, else 503."""
    views = request.app[REGISTRY_KEY].snapshot(time.monotonic())
    serving = [v for v in views if v.available and v.role != "prefill"]
    if not serving:
        return error_response(
            503, "no daemon is available to place requests on",
            type="service_unavailable_error", code="no_placement",
        )  # fmt: skip
    return web.json_response({"status": "ok", "daemons": len(serving)})
