"""OpenAI endpoints: ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``.

A request's outputs come from :class:`~edgeinfer.daemon.serving.RequestRunner`; everything
here is HTTP: admission, parsing, and writing a JSON body or an SSE stream. Whenever the
handler stops early (the client went away, or aiohttp cancelled the handler because the
connection closed) the output iterators are closed, which aborts the engine requests and
frees their KV blocks immediately instead of generating tokens nobody will read.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncGenerator
from typing import Any

from aiohttp import web

from edgeinfer.daemon.api.cache_salt import CACHE_SALT_HEADER, effective_cache_salt
from edgeinfer.daemon.api.caller import caller_of, trusted_prefill_endpoint
from edgeinfer.daemon.api.early_refusal import refuse_by_length
from edgeinfer.daemon.api.errors import SERVER_ERROR, UNAVAILABLE, APIError, json_response
from edgeinfer.daemon.api.protocol import (
    GenerateRequest,
    Kind,
    ModelInfo,
    parse_request,
)
from edgeinfer.daemon.api.request_body import decode_body
from edgeinfer.daemon.api.responses import SSE_DONE, ResponseBuilder, sse
from edgeinfer.daemon.api.structured import compile_constraint
from edgeinfer.daemon.api.tokenize_pool import POOL_KEY
from edgeinfer.daemon.api.tokenize_routes import add_tokenize_routes
from edgeinfer.daemon.engine.errors import EngineError, InvalidRequestError
from edgeinfer.daemon.engine.outputs import RequestOutput
from edgeinfer.daemon.metrics import Outcome
from edgeinfer.daemon.serving import RequestRunner, merge_streams, share_prefill
from edgeinfer.daemon.state import CONFIG_KEY, METRICS_KEY, STATE_KEY, Phase
from edgeinfer.shared.errors import EdgeInferError

log = logging.getLogger(__name__)

Outputs = AsyncGenerator[tuple[int, RequestOutput], None]

_UNAVAILABLE_MESSAGES = {
    Phase.LOADING: "the model is still loading; retry shortly",
    Phase.DRAINING: "this daemon is draining and takes no new requests",
    Phase.FAILED: "the engine of this daemon has failed",
}


def add_api_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    add_tokenize_routes(app)


def add_wrong_role_routes(app: web.Application) -> None:
    """Answer every other ``/v1/`` path of a prefill daemon with an error naming its role."""
    app.router.add_route("*", "/v1/{tail:.*}", wrong_role)


async def wrong_role(request: web.Request) -> web.StreamResponse:
    role = request.app[CONFIG_KEY].role
    raise APIError(
        404,
        f"this daemon runs with role '{role}' and serves no OpenAI API; "
        "send requests to a 'both' or 'decode' daemon",
        code="wrong_role",
    )


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def models(request: web.Request) -> web.StreamResponse:
    model = request.app[STATE_KEY].model
    if model is None:
        raise APIError(503, _UNAVAILABLE_MESSAGES[Phase.LOADING], type=UNAVAILABLE)
    card = {
        "id": model.name,
        "object": "model",
        "created": 0,
        "owned_by": "edgeinfer",
        "root": model.name,
        "parent": None,
        "max_model_len": model.max_model_len,
    }
    return json_response({"object": "list", "data": [card]})


def _admit(request: web.Request) -> tuple[RequestRunner, ModelInfo]:
    state = request.app[STATE_KEY]
    phase = state.phase
    if phase is Phase.SERVING and state.runner is not None and state.model is not None:
        return state.runner, state.model
    raise APIError(503, _UNAVAILABLE_MESSAGES[phase], type=UNAVAILABLE, code=phase.value)


async def _generate(request: web.Request, kind: Kind) -> web.StreamResponse:
    metrics = request.app[METRICS_KEY]
    state = request.app[STATE_KEY]
    caller = caller_of(request)
    # Tenants label metrics only when the router vouches for them: they then come from the
    # operator's keys file (a bounded set), never from whatever a client sends.
    tenant = caller.tenant if caller.authenticated else None
    # Tracked from admission on, so a drain also waits for requests still being parsed.
    with state.track():
        try:
            runner, model = _admit(request)
            pool = request.app[POOL_KEY]
            async with pool.admitted(request.content_length, runner.engine.lend_cores):
                body = await decode_body(
                    request,
                    pool.bodies,
                    lambda shape, long: refuse_by_length(kind, shape, long, model),
                )
                endpoint = trusted_prefill_endpoint(request, body)
                req = await pool.run(parse_request, kind, body, model, endpoint)
                if req.params.structured is not None:
                    grammars = runner.engine.engine.grammars
                    await compile_constraint(pool, grammars, req.params.structured)
        except APIError as exc:
            metrics.outcome("rejected" if exc.status == 503 else "invalid", tenant)
            raise
        builder = ResponseBuilder(req, model.name, model.tokenizer)
        log.debug("request %s: %d prompt(s), tenant %s", builder.id, len(req.prompts), tenant)
        # The header is the router's (clients' x-edge-* headers never get through it).
        salt = effective_cache_salt(request.headers.get(CACHE_SALT_HEADER), req.cache_salt)
        outputs = merge_streams(_choice_streams(runner, req, builder.id, salt))
        try:
            if req.stream:
                response, outcome = await _stream(request, builder, outputs)
            else:
                response, outcome = await _collect(builder, outputs)
        except asyncio.CancelledError:
            # aiohttp cancels the handler when the connection drops; the iterators are closed.
            metrics.outcome("client_disconnect", tenant)
            raise
        except APIError as exc:
            metrics.outcome("invalid" if exc.status < 500 else "error", tenant)
            raise
    metrics.outcome(outcome, tenant)
    return response


def _choice_streams(
    runner: RequestRunner, req: GenerateRequest, request_id: str, salt: str | None
) -> list[AsyncGenerator[RequestOutput, None]]:
    """One engine request per choice, ``n`` per prompt; a prompt's later choices start once
    its first one is prefilled, and prefill locally from the prefix cache it left."""
    streams: list[AsyncGenerator[RequestOutput, None]] = []
    for p, ids in enumerate(req.prompts):
        rid = f"{request_id}-{p * req.n}"
        first = runner.run(rid, ids, req.choice_params(0), req.prefill_endpoint, salt)
        if req.n == 1:
            streams.append(first)
            continue
        later = [
            functools.partial(
                runner.run,
                f"{request_id}-{p * req.n + i}",
                ids,
                req.choice_params(i),
                None,
                salt,
                local=True,
            )
            for i in range(1, req.n)
        ]
        streams.extend(share_prefill(first, later))
    return streams


async def _collect(builder: ResponseBuilder, outputs: Outputs) -> tuple[web.Response, Outcome]:
    try:
        async with contextlib.aclosing(outputs):
            async for index, out in outputs:
                builder.add(index, out)
    except InvalidRequestError as exc:
        raise APIError.invalid(exc) from exc
    except EngineError as exc:
        log.error("request %s failed: %s", builder.id, exc)
        raise APIError(500, f"generation failed: {exc}", type=SERVER_ERROR) from exc
    return json_response(builder.response()), "success"


async def _stream(
    request: web.Request, builder: ResponseBuilder, outputs: Outputs
) -> tuple[web.StreamResponse, Outcome]:
    response = web.StreamResponse(
        # no-cache and X-Accel-Buffering stop proxies from holding tokens back.
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
    response.content_type = "text/event-stream"
    outcome: Outcome = "success"
    try:
        await response.prepare(request)
        async with contextlib.aclosing(outputs):
            try:
                async for index, out in outputs:
                    for chunk in builder.chunks(index, out):
                        await response.write(sse(chunk))
            except (EngineError, EdgeInferError) as exc:
                # Headers are gone: the error travels as an event, then the stream ends.
                log.error("request %s failed mid-stream: %s", builder.id, exc)
                await response.write(sse(_error_event(exc)))
                outcome = "error"
        if outcome == "success" and builder.req.include_usage:
            await response.write(sse(builder.usage_chunk()))
        await response.write(SSE_DONE)
        await response.write_eof()
    except ConnectionResetError:
        # The client went away; leaving the `aclosing` block above already aborted the work.
        return response, "client_disconnect"
    return response, outcome


def _error_event(exc: Exception) -> dict[str, Any]:
    if isinstance(exc, InvalidRequestError):
        return APIError.invalid(exc).body()
    return APIError(500, f"generation failed: {exc}", type=SERVER_ERROR).body()
