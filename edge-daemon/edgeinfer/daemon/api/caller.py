"""Who is calling: the request's id, whether it presented the daemon's key, and its tenant.

A daemon sits behind the router, which authenticates clients, strips every ``x-edge-*`` header
they send and adds its own: ``x-edge-tenant`` (the tenant), ``x-edge-cache-salt`` and
``x-edge-prefill`` (the prefill daemon it chose). With ``api_key`` set, every OpenAI route needs
``Authorization: Bearer <api_key>``, the router's daemon key; a request that presents it comes
from the router, so its ``x-edge-*`` headers are believed. Without ``api_key`` (lab or private
use, warned about at start-up) any caller is believed about its tenant and cache salt, but
never about where KV pages may be fetched from: :func:`trusted_prefill_endpoint` honours an
endpoint only from a caller that presented the key, or when it is one of the configured
``prefill_peers``, so that no client can make a decode daemon connect anywhere else.

``/health``, ``/metrics`` and ``/v1/state`` stay open without the key: load balancers, Prometheus
and the routers' discovery poll them from the operations network, and they reveal load and
endpoints, never a tenant's data. ``/admin/*`` has its own token (:mod:`~.ops`).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from edgeinfer.daemon.api.errors import APIError
from edgeinfer.daemon.api.fields import PREFILL_HEADER, Fields, prefill_endpoint_value
from edgeinfer.daemon.state import CONFIG_KEY
from edgeinfer.shared.request_ids import REQUEST_ID_HEADER, bind_request_id, request_id_from

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

TENANT_HEADER = "x-edge-tenant"
# Paths served without the daemon key (the operations network's, see the module docstring).
OPEN_PATHS = frozenset({"/health", "/metrics", "/v1/state"})
_KEYED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
# A tenant name from the operator's keys file; anything longer is not one.
_MAX_TENANT_CHARS = 128


@dataclass(frozen=True)
class Caller:
    request_id: str
    authenticated: bool  # presented the daemon's api_key: the router
    tenant: str | None  # the router's x-edge-tenant, when believed


CALLER_KEY = web.RequestKey("edge_caller", Caller)


def needs_key(path: str) -> bool:
    return path not in OPEN_PATHS and path.startswith(_KEYED_PREFIXES)


def presents_key(request: web.Request, key: str) -> bool:
    """Constant-time check of ``Authorization: Bearer <key>``: digests of equal length are
    compared, so neither the key's bytes nor its length leak through timing."""
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    try:
        raw = given.strip().encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return False
    want = hashlib.sha256(key.encode()).digest()
    return hmac.compare_digest(hashlib.sha256(raw).digest(), want)


def _tenant(request: web.Request) -> str | None:
    tenant = request.headers.get(TENANT_HEADER, "").strip()
    # Log-safe: a tenant goes on access-log lines and into a metric label.
    if not tenant or len(tenant) > _MAX_TENANT_CHARS or not tenant.isprintable():
        return None
    return tenant


@web.middleware
async def caller_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Outermost: give the request its :class:`Caller` (and its id to the log lines), then
    refuse a keyed route without the daemon's key."""
    key = request.app[CONFIG_KEY].api_key
    authenticated = key is not None and presents_key(request, key)
    believed = authenticated or key is None
    caller = Caller(
        request_id=request_id_from(request.headers.get(REQUEST_ID_HEADER)),
        authenticated=authenticated,
        tenant=_tenant(request) if believed else None,
    )
    request[CALLER_KEY] = caller
    # Not unbound: aiohttp runs each request in a task of its own and writes the access-log
    # line in that task after the middlewares returned, so the line carries the id too.
    bind_request_id(caller.request_id)
    if key is not None and not authenticated and needs_key(request.path):
        # The message never repeats what was sent: it may be another service's secret.
        raise APIError(
            401,
            "this daemon needs 'Authorization: Bearer <api_key>' (the router's daemon key)",
            code="invalid_api_key",
        )
    return await handler(request)


async def stamp_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: every answer, errors and streams alike, carries the id."""
    caller = request.get(CALLER_KEY)
    if caller is not None:
        response.headers[REQUEST_ID_HEADER] = caller.request_id


def caller_of(request: web.Request) -> Caller:
    return request[CALLER_KEY]


def trusted_prefill_endpoint(request: web.Request, body: dict[str, Any]) -> str | None:
    """The prefill endpoint the request may steer this daemon to, or a 400 naming the param.

    ``x-edge-prefill`` counts when the caller presented the daemon key (the router chose it) or
    names a configured peer; ``kv_transfer_params.prefill_endpoint`` only when it names a
    configured peer. The header wins when both are given, but each is checked: a request
    naming an endpoint nobody vouches for is refused before any work and any connection.
    """
    peers = request.app[CONFIG_KEY].prefill_peers
    kv_params = Fields(body).object("kv_transfer_params") or {}
    param = "kv_transfer_params.prefill_endpoint"
    named = prefill_endpoint_value(
        Fields(kv_params, "kv_transfer_params.").text("prefill_endpoint"), param
    )
    if named is not None and named not in peers:
        raise _untrusted(param)
    header = prefill_endpoint_value(request.headers.get(PREFILL_HEADER), PREFILL_HEADER)
    if header is not None and not caller_of(request).authenticated and header not in peers:
        raise _untrusted(PREFILL_HEADER)
    return header if header is not None else named


def _untrusted(param: str) -> APIError:
    return APIError(
        400,
        f"{param} names a prefill endpoint this daemon does not trust: only its configured "
        "prefill_peers, or the router's choice on a request carrying the daemon key",
        param=param,
        code="untrusted_prefill_endpoint",
    )
