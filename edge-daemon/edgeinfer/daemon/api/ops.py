"""Operator endpoints: ``/health``, ``/metrics``, ``/v1/state`` and the ``/admin/*`` drain switch.

Every role serves these; a prefill daemon serves nothing else over HTTP. ``/v1/state`` is what
the router polls to place requests, so it reports load (queues, KV blocks) along with identity.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from edgeinfer.daemon.api.errors import APIError, json_response
from edgeinfer.daemon.engine.errors import EngineError
from edgeinfer.daemon.engine.outputs import EngineStats
from edgeinfer.daemon.state import CONFIG_KEY, METRICS_KEY, STATE_KEY, Phase

log = logging.getLogger(__name__)


def add_ops_routes(app: web.Application) -> None:
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/state", state)
    app.router.add_post("/admin/drain", drain)
    app.router.add_post("/admin/undrain", undrain)


async def health(request: web.Request) -> web.StreamResponse:
    serving = request.app[STATE_KEY]
    # Anything but "serving" is 503 so a load balancer stops sending new work here.
    code = 200 if serving.phase is Phase.SERVING else 503
    return json_response({"status": serving.status}, status=code)


async def _engine_stats(request: web.Request) -> EngineStats | None:
    engine = request.app[STATE_KEY].engine
    if engine is None or not engine.is_alive:
        return None
    # The engine may die between the check and the call; then there is simply nothing to report.
    with contextlib.suppress(EngineError):
        return await engine.call(lambda e: e.stats())
    return None


async def metrics(request: web.Request) -> web.StreamResponse:
    registry = request.app[METRICS_KEY]
    plane = request.app[STATE_KEY].plane
    if plane is not None:
        plane.export_metrics(registry)
    stats = await _engine_stats(request)
    if stats is not None:
        registry.set_engine_stats(stats)
    return web.Response(body=registry.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _state_body(request: web.Request) -> dict[str, Any]:
    config = request.app[CONFIG_KEY]
    serving = request.app[STATE_KEY]
    stats = await _engine_stats(request)
    body: dict[str, Any] = {
        "pop": config.pop,
        "role": config.role,
        "model": config.model_name,
        "status": serving.status,
        "draining": serving.draining,
        "drained": serving.status == "drained",
        "in_flight": serving.in_flight,
        "transfers_in_flight": serving.transfers_in_flight,
        "kv_endpoint": config.kv_endpoint if config.role != "decode" else None,
        "heartbeat_endpoint": config.heartbeat_endpoint,
        "block_size": config.block_size,
        "max_model_len": serving.model.max_model_len if serving.model else None,
        "running": None,
        "waiting": None,
        "kv_blocks_total": None,
        "kv_blocks_free": None,
        "kv_cache_usage": None,
    }
    if stats is not None:
        body |= {
            "running": stats.num_running,
            "waiting": stats.num_waiting,
            "kv_blocks_total": stats.kv_blocks_total,
            "kv_blocks_free": stats.kv_blocks_total - stats.kv_blocks_used,
            "kv_cache_usage": stats.kv_cache_usage,
        }
    return body


async def state(request: web.Request) -> web.StreamResponse:
    return json_response(await _state_body(request))


def _authorize(request: web.Request) -> None:
    token = request.app[CONFIG_KEY].admin_token
    if token is None:
        return
    given = request.headers.get("Authorization", "")
    # Constant-time comparison: the admin token must not leak through response timing.
    if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
        raise APIError(
            401,
            "admin endpoints need 'Authorization: Bearer <admin_token>'",
            type="authentication_error",
            code="invalid_admin_token",
        )


async def drain(request: web.Request) -> web.StreamResponse:
    _authorize(request)
    serving = request.app[STATE_KEY]
    if not serving.draining:
        log.info("draining: refusing new requests, %d in flight", serving.in_flight)
    serving.drain()
    if serving.plane is not None:
        await serving.plane.set_draining(True)
    return json_response(await _state_body(request))


async def undrain(request: web.Request) -> web.StreamResponse:
    _authorize(request)
    serving = request.app[STATE_KEY]
    if serving.draining:
        log.info("drain lifted: accepting requests again")
    serving.undrain()
    if serving.plane is not None:
        await serving.plane.set_draining(False)
    return json_response(await _state_body(request))
