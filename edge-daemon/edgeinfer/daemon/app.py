"""Build the daemon's aiohttp application: state, routes, and the engine's lifetime.

The engine is owned by a ``cleanup_ctx``: it starts loading (in a worker thread, since loading
weights blocks) when the app starts and is stopped when the app shuts down. Loading runs in the
background so the HTTP port is open, answering ``/health`` with 503, while the model loads;
``ServingState.settled`` tells the owner (``main`` or a test) when loading ended and how.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator

from aiohttp import web

from edgeinfer.daemon.api.caller import caller_middleware, stamp_request_id
from edgeinfer.daemon.api.errors import error_middleware
from edgeinfer.daemon.api.handlers import add_api_routes, add_wrong_role_routes
from edgeinfer.daemon.api.ops import add_ops_routes
from edgeinfer.daemon.api.protocol import ModelInfo
from edgeinfer.daemon.api.request_body import MAX_BODY_BYTES
from edgeinfer.daemon.api.token_bytes import chars_per_token_bound
from edgeinfer.daemon.api.tokenize_pool import POOL_KEY, TokenizePool
from edgeinfer.daemon.config import DaemonConfig
from edgeinfer.daemon.engine.async_engine import AsyncEngine
from edgeinfer.daemon.engine.llm_engine import LLMEngine
from edgeinfer.daemon.listeners import Listeners
from edgeinfer.daemon.load_report import LoadTracker
from edgeinfer.daemon.metrics import DaemonMetrics
from edgeinfer.daemon.serving import RequestRunner
from edgeinfer.daemon.state import CONFIG_KEY, METRICS_KEY, STATE_KEY, ServingState
from edgeinfer.daemon.transfer_plane import TransferPlane, TransferPlaneError
from edgeinfer.shared.errors import EdgeInferError
from edgeinfer.shared.openapi import add_openapi_route
from edgeinfer.shared.tasks import cancel_and_wait

log = logging.getLogger(__name__)


class DaemonError(EdgeInferError):
    """The daemon cannot start or keep running: port in use, model not loadable."""


def build_app(
    config: DaemonConfig, *, engine: LLMEngine | None = None, listeners: Listeners | None = None
) -> web.Application:
    """The daemon's app; ``engine`` reuses an already loaded engine (tests) instead of loading
    ``config.model``. The app owns the engine's thread, not the engine. ``listeners``: the
    ZeroMQ ports bound at start-up (``main``); without them the sockets bind their own."""
    # The caller middleware runs inside the error one, so a 401 too is an OpenAI error body.
    app = web.Application(
        middlewares=[error_middleware, caller_middleware], client_max_size=MAX_BODY_BYTES
    )
    app[CONFIG_KEY] = config
    app[METRICS_KEY] = DaemonMetrics()
    app[STATE_KEY] = ServingState()
    app[POOL_KEY] = TokenizePool(large_body_share=config.large_body_share)
    app.on_response_prepare.append(stamp_request_id)
    app.on_cleanup.append(_stop_pool)
    app.cleanup_ctx.append(functools.partial(_engine_ctx, prebuilt=engine, listeners=listeners))
    add_ops_routes(app)
    if config.serves_api:
        add_api_routes(app)
        add_openapi_route(app)
    else:
        add_wrong_role_routes(app)
    return app


async def _stop_pool(app: web.Application) -> None:
    await app[POOL_KEY].close()


async def _engine_ctx(
    app: web.Application, *, prebuilt: LLMEngine | None, listeners: Listeners | None
) -> AsyncIterator[None]:
    state = app[STATE_KEY]
    loader = asyncio.create_task(_load(app, prebuilt, listeners), name="edgeinfer-load")
    yield
    await cancel_and_wait(loader)
    if state.plane is not None:
        # In-flight KV transfers finish first (drain-safe), then the engine stops.
        await state.plane.stop(drain=True)
    if state.engine is not None:
        await state.engine.stop()


async def _load(
    app: web.Application, prebuilt: LLMEngine | None, listeners: Listeners | None
) -> None:
    config = app[CONFIG_KEY]
    state = app[STATE_KEY]
    try:
        if prebuilt is not None:
            engine = AsyncEngine(prebuilt)
            engine.start()
        else:
            log.info("loading model %s", config.model_name)
            engine_config = config.to_engine_config()
            engine = await AsyncEngine.launch(lambda: LLMEngine(engine_config))
    except Exception as exc:  # any failure to load is reported, then main exits
        log.error("cannot load model %s: %s", config.model_name, exc)
        state.failed(exc)
        return
    llm = engine.engine
    metrics = app[METRICS_KEY]
    load = LoadTracker(config, engine, metrics, state.load_status)
    plane = TransferPlane(config, engine, load, metrics, listeners)
    try:
        await plane.start()
    except TransferPlaneError as exc:
        log.error("%s", exc)
        await engine.stop()
        state.failed(exc)
        return
    state.plane = plane
    bm = llm.block_manager
    model = ModelInfo(
        name=config.model_name,
        tokenizer=llm.tokenizer,
        vocab_size=llm.model_config.vocab_size,
        max_model_len=llm.max_model_len,
        kv_capacity_tokens=bm.num_blocks * bm.block_size,
        tool_call_parser=config.tool_call_parser,
    )
    # Read from the vocabulary now rather than by the first long prompt (~0.1 s, GIL held).
    await asyncio.to_thread(chars_per_token_bound, llm.tokenizer)
    state.loaded(engine, RequestRunner(engine, config, metrics, plane), model)
    log.info(
        "model %s ready: %d KV blocks of %d tokens, context %d",
        config.model_name,
        bm.num_blocks,
        bm.block_size,
        llm.max_model_len,
    )
