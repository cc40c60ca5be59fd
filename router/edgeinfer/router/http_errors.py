"""Every answer the router makes itself is an OpenAI error object, whatever raised it.

aiohttp answers an unknown path (404), a wrong method (405), an oversized body (413) or a
malformed request with ``text/plain``; a Gate refusal (401/403/429) arrives as a
:class:`GateRejection`; a bug would become aiohttp's bare 500. This middleware turns each into
``{"error": {"message", "type", "param", "code"}}`` with ``application/json``, keeping the
headers that matter (``Allow``, ``Retry-After``, ``x-ratelimit-*``). A bug is logged with its
traceback (and the request id, like every line about the request); the client gets only the id.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from edgeinfer.router.gate import GateRejection
from edgeinfer.router.openai_api import error_response
from edgeinfer.router.request_context import CONTEXT_KEY

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# OpenAI's error types by status; anything else 4xx is an invalid request, 5xx a server error.
_TYPES = {
    401: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}
_CODES = {
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    504: "timeout",
}
_KEPT_HEADERS = frozenset({"allow", "retry-after", "www-authenticate"})


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except GateRejection as rejection:
        ctx = request.get(CONTEXT_KEY)
        if ctx is not None and rejection.tenant:
            ctx.tenant = rejection.tenant  # a 403 or 429 still counts against its tenant
        resp = web.json_response(rejection.body, status=rejection.status)
        resp.headers.update(rejection.headers)
        return resp
    except web.HTTPException as exc:
        if exc.status < 400:  # a redirect is an answer, not an error
            raise
        return _from_http_exception(request, exc)
    except Exception:
        ctx = request.get(CONTEXT_KEY)
        log.exception("internal error answering %s %s", request.method, request.path)
        if ctx is not None and ctx.response is not None:
            # Headers are gone: cutting the connection is the only honest signal left.
            if request.transport is not None:
                request.transport.abort()
            return ctx.response
        request_id = ctx.request_id if ctx is not None else "unknown"
        return error_response(
            500, f"internal error in the router (request id {request_id})",
            type="server_error", code="internal_error",
        )  # fmt: skip


def _from_http_exception(request: web.Request, exc: web.HTTPException) -> web.Response:
    status = exc.status
    if status == 404:
        message = f"Invalid URL ({request.method} {request.path})"
    elif status == 405:
        message = f"method {request.method} is not allowed on {request.path}"
    else:
        message = exc.text if exc.text and exc.content_type == "text/plain" else exc.reason
        message = message.removeprefix(f"{status}: ")
    resp = error_response(
        status,
        message,
        type=_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
        code=_CODES.get(status),
    )
    resp.headers.update({k: v for k, v in exc.headers.items() if k.lower() in _KEPT_HEADERS})
    return resp
