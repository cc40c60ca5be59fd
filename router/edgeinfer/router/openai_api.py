"""The OpenAI API surface the router shares with the daemons: error bodies and request sizing.

Errors use OpenAI's ``{"error": {"message", "type", "param", "code"}}`` body, exactly like the
daemon's, so a client cannot tell a router refusal from a daemon one by its shape and the
``openai`` SDK raises the same typed exceptions for both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
from aiohttp import web

from edgeinfer.router.pop_registry import DaemonView
from edgeinfer.router.selector import RequestFeatures

# OpenAI's default for /v1/completions; chat has none, and a guess this size keeps placement
# from treating an open-ended chat as free.
DEFAULT_MAX_TOKENS = 256


# Body fields that name infrastructure (where KV pages come from, which rank runs a request):
# only the router chooses that, so a client body carrying one is refused before placement.
INFRASTRUCTURE_FIELDS = ("kv_transfer_params", "data_parallel_rank")


def parse_body(body: bytes) -> Any:
    """The JSON body, or None when it is not JSON (the daemon then words the 400)."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None


def infrastructure_field(data: Any) -> web.Response | None:
    """A 400 naming the first field of :data:`INFRASTRUCTURE_FIELDS` the body sets, else None."""
    if isinstance(data, dict):
        for name in INFRASTRUCTURE_FIELDS:
            if name in data:
                return error_response(
                    400, f"'{name}' is set by the router, not by clients; remove it",
                    param=name, code="infrastructure_field",
                )  # fmt: skip
    return None


def request_features(body: bytes, data: Any = None) -> RequestFeatures:
    """What placement needs from a request body, estimated cheaply: ~4 characters per token.

    ``data`` is the body already parsed, when it was. Never fails: a body the daemon will reject
    still gets placed so that the daemon's own 4xx (with its exact message) reaches the client.
    """
    if data is None:
        data = parse_body(body)
    if not isinstance(data, dict):
        return RequestFeatures(
            prompt_tokens=len(body) // 4, max_tokens=DEFAULT_MAX_TOKENS, model=None
        )
    prompt = data.get("prompt", data.get("messages"))
    max_tokens = data.get("max_completion_tokens") or data.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        max_tokens = DEFAULT_MAX_TOKENS
    model = data.get("model")
    return RequestFeatures(
        prompt_tokens=max(1, _prompt_tokens(prompt)),
        max_tokens=max_tokens,
        model=model if isinstance(model, str) else None,
    )


def _prompt_tokens(prompt: Any) -> int:
    if isinstance(prompt, str):
        return len(prompt) // 4
    if isinstance(prompt, int):
        return 1  # one token id of a pre-tokenized prompt
    if isinstance(prompt, list):
        return sum(_prompt_tokens(item) for item in prompt)
    if isinstance(prompt, dict):  # a chat message, or one content part of it
        return _prompt_tokens(prompt.get("content")) + _prompt_tokens(prompt.get("text"))
    return 0


def error_response(
    status: int,
    message: str,
    *,
    type: str = "invalid_request_error",  # shadows the builtin: OpenAI names the field so
    param: str | None = None,
    code: str | None = None,
) -> web.Response:
    """An OpenAI-shaped error, so clients raise the same typed exceptions as for a daemon."""
    error = {"message": message, "type": type, "param": param, "code": code}
    return web.Response(
        body=orjson.dumps({"error": error}), status=status, content_type="application/json"
    )


def sse_error_event(message: str) -> bytes:
    error = {"message": message, "type": "server_error", "param": None, "code": "upstream_failed"}
    return b"data: " + orjson.dumps({"error": error}) + b"\n\ndata: [DONE]\n\n"


def no_placement(views: Sequence[DaemonView], features: RequestFeatures) -> web.Response:
    """Why select() found nothing: an unknown model (404) or no capacity now (503)."""
    if features.model is not None and all(v.model != features.model for v in views):
        return error_response(
            404, f"the model '{features.model}' does not exist", param="model",
            code="model_not_found",
        )  # fmt: skip
    return error_response(
        503, "no PoP can take this request now; retry shortly",
        type="service_unavailable_error", code="no_placement",
    )  # fmt: skip
