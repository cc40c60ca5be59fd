"""Operator endpoints: ``/health``, ``/metrics``, ``/v1/state`` and the ``/admin/*`` drain switch.

Every role serves these; a prefill daemon serves nothing else over HTTP. ``/v1/state`` is what
the router polls to place requests, so it reports load (queues, KV blocks) along with identity.
The first three need no key (see :mod:`~edgeinfer.daemon.api.caller`); ``/admin/*`` needs
``admin_token`` and is closed (403) when none is set.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from edgeinfer.daemon.api.caller import presents_key
from edgeinfer.daemon.api.errors import UNAVAILABLE, APIError, json_response
from edgeinfer.daemon.engine.errors import EngineError
from edgeinfer.daemon.engine.outputs import EngineStats
from edgeinfer.daemon.kv_events import tokenizer_description
from edgeinfer.daemon.state import CONFIG_KEY, METRICS_KEY, STATE_KEY, Phase
from edgeinfer.kernels import kernel_choice

log = logging.getLogger(__name__)


def add_ops_routes(app: web.Application) -> None:
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/state", state)
    app.router.add_get("/v1/kv_snapshot", kv_snapshot)
    app.router.add_get("/v1/tokenizer", tokenizer)
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
        # The invariants routers price placements with (also in every heartbeat).
        **(serving.plane.load.invariants if serving.plane is not None else {}),
        "max_model_len": serving.model.max_model_len if serving.model else None,
        "running": None,
        "waiting": None,
        "kv_blocks_total": None,
        "kv_blocks_free": None,
        "kv_cache_usage": None,
        # The compiled CPU kernels chosen at load and their speed against what they replace.
        "kernels": kernel_choice.summary(),
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


async def kv_snapshot(request: web.Request) -> web.StreamResponse:
    """Every key in the prefix cache (msgpack :class:`KvSnapshot`), for a router's index.
    Keyed like the rest of ``/v1``: salted keys say which tenants' prompts are cached."""
    serving = request.app[STATE_KEY]
    events = serving.plane.kv_events if serving.plane is not None else None
    engine = serving.engine
    if events is None or engine is None or not engine.is_alive:
        raise APIError(503, "no prefix cache to snapshot", type=UNAVAILABLE, code="no_kv_snapshot")
    try:
        snap = await engine.call(events.snapshot)
    except EngineError as e:
        raise APIError(503, str(e), type=UNAVAILABLE, code="no_kv_snapshot") from e
    return web.Response(body=snap.encode(), content_type="application/vnd.msgpack")


async def tokenizer(request: web.Request) -> web.StreamResponse:
    """How this daemon turns requests into token ids (tokenizer.json, chat template, special
    tokens) and its ``tokenizer_id``, for a router to compute the same block keys. Keyed like
    the rest of ``/v1``; fetched once per ``tokenizer_id``."""
    engine = request.app[STATE_KEY].engine
    if engine is None or not engine.is_alive:
        raise APIError(503, "the model is not loaded", type=UNAVAILABLE, code="no_tokenizer")
    try:
        body = await engine.call(tokenizer_description)
    except EngineError as e:
        raise APIError(503, str(e), type=UNAVAILABLE, code="no_tokenizer") from e
    return json_response(body)


def _authorize(request: web.Request) -> None:
    token = request.app[CONFIG_KEY].admin_token
    if token is None:
        # Closed, not open: whoever reaches the port could otherwise drain the daemon.
        raise APIError(
            403,
            "admin endpoints are disabled: set admin_token (EDGEINFER_ADMIN_TOKEN) to use them",
            type="permission_error",
            code="admin_disabled",
        )
    # Constant-time comparison: the admin token must not leak through response timing.
    if not presents_key(request, token):
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
