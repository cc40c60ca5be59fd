"""The router's aiohttp application: the OpenAI API, ``/health``, ``/metrics`` and the admin API.

Everything with a lifetime (the tenant Gate, the pooled upstream ``ClientSession``, the heartbeat
listener, discovery, RTT probing and the dead-daemon watch) starts and stops in one
``cleanup_ctx`` generator, so it shuts down in reverse order after aiohttp has let in-flight
streams finish. Three middlewares wrap every route, outermost first: the request context (id,
logging), metrics, and OpenAI-shaped errors. Every ``/v1/*`` request passes the Gate (API key,
model, limits) before anything else is done for it.
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

from edgeinfer.router.access_log import AccessLog
from edgeinfer.router.admin import create_admin_app
from edgeinfer.router.config import RouterConfig, load_pops
from edgeinfer.router.cors import enable_cors
from edgeinfer.router.daemon_key import DaemonKey
from edgeinfer.router.daemon_watch import DaemonWatch
from edgeinfer.router.discovery import Discovery
from edgeinfer.router.gate import GATE_KEY, Gate
from edgeinfer.router.geo import ClientLocator, GeoPoint
from edgeinfer.router.heartbeat_listener import HeartbeatListener
from edgeinfer.router.http_errors import error_middleware
from edgeinfer.router.kv_sync import KvSyncCollector, SnapshotFetcher
from edgeinfer.router.metrics import (
    METRICS_KEY,
    GateCollector,
    RouterMetrics,
    metrics_handler,
    metrics_middleware,
)
from edgeinfer.router.network import NetworkModel, RttProber
from edgeinfer.router.openai_api import (
    error_response,
    infrastructure_field,
    parse_body,
    request_features,
)
from edgeinfer.router.pop_registry import PopConfig, PopRegistry
from edgeinfer.router.prefix_lookup import PrefixLookup
from edgeinfer.router.proxy import PROXY_KEY, Proxy
from edgeinfer.router.request_context import (
    CONTEXT_KEY,
    request_context_middleware,
    stamp_response,
)
from edgeinfer.shared.openapi import add_openapi_route
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
DAEMON_KEY_KEY = web.AppKey("daemon_key", DaemonKey)


def create_app(setup: RouterSetup) -> web.Application:
    config = setup.config
    app = web.Application(
        middlewares=[request_context_middleware, metrics_middleware, error_middleware],
        # The daemon's own limit: a prompt it would accept is never refused here, and one it
        # would refuse reaches it, to be answered with its exact context-length message.
        client_max_size=config.max_body_bytes,
    )
    app[SETUP_KEY] = setup
    app[REGISTRY_KEY] = PopRegistry(setup.pops, config.here, config.heartbeat_interval_s)
    app[METRICS_KEY] = RouterMetrics()
    app[METRICS_KEY].registry.register(KvSyncCollector(app[REGISTRY_KEY].kv))
    app[METRICS_KEY].registry.register(GateCollector(app))
    app[DAEMON_KEY_KEY] = DaemonKey(config.daemon_api_key_file)
    app.on_response_prepare.append(stamp_response)
    app.cleanup_ctx.append(_services)
    api = [
        app.router.add_post("/v1/completions", _forward),
        app.router.add_post("/v1/chat/completions", _forward),
        app.router.add_get("/v1/models", models),
        # vLLM's tokenizer endpoints: keyed and placed like completions, served by the daemon.
        app.router.add_post("/tokenize", _forward),
        app.router.add_post("/detokenize", _forward),
    ]
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_handler)
    add_openapi_route(app)
    app.add_subapp("/admin", create_admin_app(setup.admin_token))
    enable_cors(app, config.cors_allowed_origins, api)
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
        access_log_class=AccessLog,
    )


async def _services(app: web.Application) -> AsyncIterator[None]:
    setup, registry = app[SETUP_KEY], app[REGISTRY_KEY]
    config = setup.config
    connector = aiohttp.TCPConnector(limit=config.pool_limit, limit_per_host=0)
    session = aiohttp.ClientSession(
        connector=connector,
        # A daemon's cookies must not be replayed to it on other clients' requests.
        cookie_jar=aiohttp.DummyCookieJar(),
        # Bytes pass through as the daemon encoded them.
        auto_decompress=False,
        # Only the connect is timed here: the proxy's request_timeout_s bounds the rest, and a
        # read timeout would cut a non-streaming generation that is silent until it is done.
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=config.connect_timeout_s),
    )
    here = next(p for p in setup.pops if p.name == config.here)
    locator = ClientLocator(
        config.geoip_db, config.trusted_proxies, fallback=GeoPoint(here.lat, here.lon)
    )
    daemon_key = app[DAEMON_KEY_KEY]
    listener = HeartbeatListener(registry, config.heartbeat_interval_s)
    discovery = Discovery(listener, session, config.discovery_interval_s, daemon_key)
    snapshots = SnapshotFetcher(registry.kv, session, daemon_key)
    prober = RttProber(registry, config.rtt_probe_interval_s)
    watch = DaemonWatch(registry, config.heartbeat_interval_s)
    gate = await Gate.create(config)
    app[GATE_KEY] = gate
    prefix = (
        PrefixLookup(registry.prefix_index, session, daemon_key, app[METRICS_KEY])
        if config.prefix_aware_placement
        else None
    )
    app[PROXY_KEY] = Proxy(
        config,
        registry,
        locator,
        NetworkModel(catchment_km=config.catchment_km),
        session,
        random.Random(),
        daemon_key=daemon_key,
        watch=watch,
        metrics=app[METRICS_KEY],
        prefix=prefix,
    )
    app[DISCOVERY_KEY] = discovery
    await listener.start()
    await snapshots.start()
    await prober.start()
    discovery.sync(setup.pops)
    discovery_task = asyncio.create_task(discovery.run(), name="discovery")
    watch_task = asyncio.create_task(watch.run(), name="daemon-watch")
    try:
        yield
    finally:
        await cancel_and_wait(watch_task)
        await cancel_and_wait(discovery_task)
        await prober.stop()
        await snapshots.stop()
        await listener.stop()
        if prefix is not None:
            await prefix.close()
        await session.close()
        await gate.close()
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


def reload_daemon_key(app: web.Application) -> None:
    """SIGHUP: re-read ``daemon_api_key_file``; a bad file keeps the current key (logged)."""
    app[DAEMON_KEY_KEY].reload()


async def _forward(request: web.Request) -> web.StreamResponse:
    ctx = request[CONTEXT_KEY]
    body = await request.read()  # past max_body_bytes: 413
    data = parse_body(body)
    features = request_features(body, data)
    gate = request.app[GATE_KEY]
    admission = ctx.admitted(await gate.admit(request, features.model, features.prompt_tokens))
    try:
        refused = infrastructure_field(data)
        if refused is not None:
            return refused
        return await request.app[PROXY_KEY].forward(request, ctx, body, features, data)
    finally:
        await admission.finish()


async def models(request: web.Request) -> web.StreamResponse:
    """Every model some available daemon serves: what a request here can be placed for."""
    ctx = request[CONTEXT_KEY]
    admission = ctx.admitted(await request.app[GATE_KEY].admit(request, None, 0))
    try:
        views = request.app[REGISTRY_KEY].snapshot(time.monotonic())
        serving = {v.model for v in views if v.available and v.model and v.role != "prefill"}
        data = [
            {"id": n, "object": "model", "created": 0, "owned_by": "edgeinfer"}
            for n in sorted(serving)
        ]
        return web.json_response({"object": "list", "data": data})
    finally:
        await admission.finish()


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
