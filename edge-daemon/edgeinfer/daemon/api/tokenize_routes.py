"""``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes.

``/tokenize`` takes a completion ``prompt`` (string; ``add_special_tokens``, default true) or a
chat's ``messages`` (rendered exactly as ``/v1/chat/completions`` would prefill them, with
``add_generation_prompt`` and ``chat_template_kwargs``), and answers ``{"count",
"max_model_len", "tokens"}``, plus ``"token_strs"`` (the vocabulary entries) with
``return_token_strs``. ``/detokenize`` takes ``tokens`` and answers ``{"prompt"}``. Both need the
daemon key like ``/v1/*`` (:mod:`~edgeinfer.daemon.api.caller`), and parse on the tokenize
pool, off the event loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aiohttp import web

from edgeinfer.daemon.api.body_shape import Long
from edgeinfer.daemon.api.early_refusal import refuse_by_length
from edgeinfer.daemon.api.errors import UNAVAILABLE, APIError, json_response
from edgeinfer.daemon.api.fields import Fields
from edgeinfer.daemon.api.prompt_length import encode_within
from edgeinfer.daemon.api.protocol import Kind, ModelInfo, chat_prompt_ids, check_model
from edgeinfer.daemon.api.request_body import decode_body
from edgeinfer.daemon.api.tokenize_pool import POOL_KEY
from edgeinfer.daemon.state import STATE_KEY


def add_tokenize_routes(app: web.Application) -> None:
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)


def _model(request: web.Request, body: dict[str, Any]) -> ModelInfo:
    model = request.app[STATE_KEY].model
    if model is None:
        raise APIError(503, "the model is still loading; retry shortly", type=UNAVAILABLE)
    check_model(Fields(body), model)
    return model


async def _body(request: web.Request) -> dict[str, Any]:
    pool = request.app[POOL_KEY]
    model = request.app[STATE_KEY].model

    def refuse(shape: dict[str, Any], long: Mapping[str, Long]) -> None:
        if model is not None:
            kind: Kind = "chat" if shape.get("messages") is not None else "completion"
            refuse_by_length(kind, shape, long, model)

    async with pool.admitted(request.content_length):
        return await decode_body(request, pool.bodies, refuse)


def _tokenize(body: dict[str, Any], model: ModelInfo) -> dict[str, Any]:
    f = Fields(body)
    if body.get("messages") is not None:
        if body.get("prompt") is not None:
            raise APIError(400, "send either prompt or messages, not both", param="prompt")
        if f.flag("add_special_tokens", False):
            # The chat template writes every special token itself, as for generation.
            raise APIError(
                400, "add_special_tokens is not supported with messages", param="add_special_tokens"
            )
        ids = chat_prompt_ids(body, model)
    else:
        prompt = f.text("prompt")
        if prompt is None:
            raise APIError(400, "prompt (a string) or messages is required", param="prompt")
        ids = encode_within(
            model.tokenizer,
            prompt,
            model.max_model_len,
            "prompt",
            add_special_tokens=f.flag("add_special_tokens", True),
        )
    answer: dict[str, Any] = {
        "count": len(ids),
        "max_model_len": model.max_model_len,
        "tokens": ids,
    }
    if f.flag("return_token_strs", False):
        answer["token_strs"] = [model.tokenizer.id_to_token(t) for t in ids]
    return answer


async def tokenize(request: web.Request) -> web.StreamResponse:
    body = await _body(request)
    model = _model(request, body)
    return json_response(await request.app[POOL_KEY].run(_tokenize, body, model))


def _detokenize(body: dict[str, Any], model: ModelInfo) -> dict[str, Any]:
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise APIError(400, "tokens must be a list of token ids", param="tokens")
    if any(not 0 <= t < model.vocab_size for t in tokens):
        raise APIError(400, f"tokens must be ids in [0, {model.vocab_size})", param="tokens")
    return {"prompt": model.tokenizer.decode(tokens, skip_special_tokens=False)}


async def detokenize(request: web.Request) -> web.StreamResponse:
    body = await _body(request)
    model = _model(request, body)
    return json_response(await request.app[POOL_KEY].run(_detokenize, body, model))
