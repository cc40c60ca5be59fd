"""How errors reach clients: OpenAI's error body, for every failure the daemon answers.

OpenAI clients parse ``{"error": {"message", "type", "param", "code"}}`` into typed exceptions,
so every non-2xx answer (ours, aiohttp's 404/405/413, and unexpected bugs) uses that body.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from edgeinfer.daemon.engine.errors import InvalidRequestError
from edgeinfer.shared.errors import EdgeInferError

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
UNAVAILABLE = "service_unavailable_error"


class APIError(EdgeInferError):
    """A request the daemon refuses, with the HTTP status and OpenAI error fields to send."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,  # shadows the builtin: OpenAI names the field so
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    @classmethod
    def invalid(cls, exc: InvalidRequestError) -> APIError:
        return cls(400, str(exc), param=exc.param)

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> web.Response:
        return json_response(self.body(), status=self.status)


def json_response(data: Any, *, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        # aiohttp's own refusals (no such route, wrong method, body too large) in OpenAI shape.
        kind = SERVER_ERROR if exc.status >= 500 else INVALID_REQUEST
        return APIError(exc.status, exc.reason, type=kind).response()
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return APIError(500, "internal server error", type=SERVER_ERROR).response()
