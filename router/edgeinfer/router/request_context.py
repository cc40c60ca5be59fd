"""What the router knows about the request it is answering: its id, tenant and placement.

The outermost middleware gives every request a :class:`RequestContext`: the client's
``X-Request-Id`` when it is a sane token, else a fresh one, bound for logging
(:mod:`edgeinfer.shared.request_ids`) so every log line about the request carries it, the access
log line included. One ``on_response_prepare`` hook then stamps every answer, the router's own
errors and the daemon's streams alike, with the id and the tenant's ``x-ratelimit-*`` headers.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from edgeinfer.router.gate import Admission
from edgeinfer.shared.request_ids import REQUEST_ID_HEADER, bind_request_id, request_id_from

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class RequestContext:
    request_id: str
    admission: Admission | None = None  # set once the Gate let the request in
    tenant: str = ""  # once the Gate knows the key ("" without keys, or before)
    pop: str = ""  # the PoP of the decode daemon that answered, once placed
    response: web.StreamResponse | None = None  # the answer, once its headers are sent

    def admitted(self, admission: Admission) -> Admission:
        self.admission = admission
        self.tenant = admission.tenant or ""
        return admission


CONTEXT_KEY = web.RequestKey("edge_context", RequestContext)


def context_of(request: web.Request) -> RequestContext:
    return request[CONTEXT_KEY]


@web.middleware
async def request_context_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    ctx = RequestContext(request_id_from(request.headers.get(REQUEST_ID_HEADER)))
    request[CONTEXT_KEY] = ctx
    # Not unbound on the way out: aiohttp runs each request in a task of its own, and the
    # access log line is written in that task after this middleware has returned.
    bind_request_id(ctx.request_id)
    return await handler(request)


async def stamp_response(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: the request id and rate-limit headers go on every answer."""
    ctx = request.get(CONTEXT_KEY)
    if ctx is None:  # refused before the middlewares ran (a malformed request line)
        return
    ctx.response = response
    response.headers[REQUEST_ID_HEADER] = ctx.request_id
    if ctx.admission is not None:
        response.headers.update(ctx.admission.response_headers())
