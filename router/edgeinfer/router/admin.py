"""The router's admin API (``/admin/*``, bearer token): PoP and daemon state, drain and undrain.

Draining is the L7 step before an operator withdraws a PoP's anycast route. The router that
receives the call stops placing work there before it answers, then passes the drain on to the
PoP's daemons (``POST /admin/drain``, same token) so that every other router sees the daemons
draining in their state and stops too. Streams already running finish; ``in_flight`` says how
many are left (this router's own count, or the daemons' if they report more).
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from edgeinfer.router.errors import RouterError
from edgeinfer.router.openai_api import error_response
from edgeinfer.router.pop_registry import DaemonView
from edgeinfer.router.proxy import PROXY_KEY, Proxy

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_DAEMON_CALL_TIMEOUT = aiohttp.ClientTimeout(total=3.0)


@dataclass(frozen=True)
class AdminAuth:
    token: str | None  # None: no token file configured, so the admin API is closed


AUTH_KEY = web.AppKey("admin_auth", AdminAuth)


def create_admin_app(token: str | None) -> web.Application:
    """The admin sub-application, mounted at ``/admin``; it uses the parent's :class:`Proxy`."""
    app = web.Application(middlewares=[_auth])
    app[AUTH_KEY] = AdminAuth(token)
    app.router.add_get("/pops", list_pops)
    app.router.add_get("/pops/{name}", get_pop)
    app.router.add_post("/pops/{name}/drain", drain_pop)
    app.router.add_post("/pops/{name}/undrain", undrain_pop)
    app.router.add_post("/daemons/drain", drain_daemon)
    app.router.add_post("/daemons/undrain", undrain_daemon)
    return app


@web.middleware
async def _auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    token = request.app[AUTH_KEY].token
    if token is None:
        return error_response(
            403, "the admin API is disabled: the router has no admin_token_file",
            type="permission_error", code="admin_disabled",
        )  # fmt: skip
    given = request.headers.get("Authorization", "")
    # Constant-time comparison: the token must not leak through response timing.
    if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
        resp = error_response(
            401, "admin endpoints need 'Authorization: Bearer <admin token>'",
            type="authentication_error", code="invalid_admin_token",
        )  # fmt: skip
        resp.headers["WWW-Authenticate"] = "Bearer"
        return resp
    try:
        return await handler(request)
    except RouterError as e:
        # The registry's only refusal is a name it does not know.
        return error_response(404, str(e), code="not_found")


def daemon_state(view: DaemonView) -> str:
    """One word for the status table; ``reason`` has the detail."""
    if view.available:
        return "up"
    if view.admin_drained or view.draining:
        return "draining"
    return "full" if view.reason == "KV cache full" else "down"


def daemon_json(view: DaemonView, now: float, proxy: Proxy | None = None) -> dict[str, Any]:
    total = view.kv_blocks_total
    # The prefix cache as this router knows it: blocks its index holds for the daemon, and
    # blocks this router's placements found cached there (reused instead of computed).
    cached = proxy.registry.prefix_index.held_by(view.url) if proxy is not None else None
    hit = proxy.prefix_hit_blocks[view.url] if proxy is not None else None
    return {
        "url": view.url,
        "pop": view.pop,
        "role": view.role,
        "model": view.model,
        "kv_endpoint": view.kv_endpoint,
        "state": daemon_state(view),
        "reason": view.reason,
        "running": view.running if view.role is not None else None,
        "waiting": view.waiting if view.role is not None else None,
        "in_flight": view.in_flight,
        "kv_free": view.kv_blocks_free / total if total else None,
        "ttft_p50_ms": None if view.ttft_p50_s is None else view.ttft_p50_s * 1000,
        "heartbeat_age_s": None if view.last_seen is None else max(0.0, now - view.last_seen),
        "cached_blocks": cached,
        "hit_blocks": hit,
    }


def _pop_json(proxy: Proxy, name: str, views: Sequence[DaemonView], now: float) -> dict[str, Any]:
    pop = proxy.registry.pop(name)
    return {
        "name": pop.name,
        "lat": pop.lat,
        "lon": pop.lon,
        "draining": proxy.registry.pop_drained(name),
        # This router's measured round trip to the PoP (EWMA of /health probes); None: unprobed.
        "rtt_ms": None if (rtt := proxy.registry.rtt(name)) is None else rtt * 1000,
        # This router's own count is exact now; the daemons' (all routers) lags a heartbeat.
        "in_flight": max(proxy.in_flight[name], proxy.registry.in_flight(name, now)),
        "daemons": [daemon_json(v, now, proxy) for v in views if v.pop == name],
    }


async def list_pops(request: web.Request) -> web.StreamResponse:
    proxy = request.config_dict[PROXY_KEY]
    now = time.monotonic()
    views = proxy.registry.snapshot(now)
    pops = [_pop_json(proxy, p.name, views, now) for p in proxy.registry.pops()]
    return _json({"here": proxy.config.here, "pops": pops})


async def get_pop(request: web.Request) -> web.StreamResponse:
    proxy = request.config_dict[PROXY_KEY]
    name = request.match_info["name"]
    now = time.monotonic()
    body = _pop_json(proxy, name, proxy.registry.snapshot(now), now)
    # Other routers' streams count too: ask the daemons themselves how many they still serve.
    # A prefill daemon's work for decode daemons elsewhere is in transfers_in_flight, not in
    # in_flight; a route withdrawn under it would cut those transfers off.
    states = await _call_daemons(request, [d["url"] for d in body["daemons"]], "GET", "/v1/state")
    reported = sum(
        int(s.get("in_flight") or 0) + int(s.get("transfers_in_flight") or 0)
        for s in states.values()
        if isinstance(s, dict)
    )
    body["in_flight"] = max(body["in_flight"], reported)
    return _json(body)


async def drain_pop(request: web.Request) -> web.StreamResponse:
    return await _set_pop(request, drain=True)


async def undrain_pop(request: web.Request) -> web.StreamResponse:
    return await _set_pop(request, drain=False)


async def _set_pop(request: web.Request, *, drain: bool) -> web.StreamResponse:
    proxy = request.config_dict[PROXY_KEY]
    name = request.match_info["name"]
    registry = proxy.registry
    # Local first: once this returns, no request placed by this router goes there.
    registry.drain_pop(name) if drain else registry.undrain_pop(name)
    now = time.monotonic()
    body = _pop_json(proxy, name, registry.snapshot(now), now)
    path = "/admin/drain" if drain else "/admin/undrain"
    results = await _call_daemons(request, [d["url"] for d in body["daemons"]], "POST", path)
    body["daemon_errors"] = {url: r for url, r in results.items() if isinstance(r, str)}
    return _json(body)


async def drain_daemon(request: web.Request) -> web.StreamResponse:
    return await _set_daemon(request, drain=True)


async def undrain_daemon(request: web.Request) -> web.StreamResponse:
    return await _set_daemon(request, drain=False)


async def _set_daemon(request: web.Request, *, drain: bool) -> web.StreamResponse:
    proxy = request.config_dict[PROXY_KEY]
    try:
        url = orjson.loads(await request.read())["url"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return error_response(400, 'the body must be {"url": "<daemon base URL>"}', param="url")
    if not isinstance(url, str):
        return error_response(400, "'url' must be a string", param="url")
    url = url.rstrip("/")
    registry = proxy.registry
    registry.drain_daemon(url) if drain else registry.undrain_daemon(url)
    path = "/admin/drain" if drain else "/admin/undrain"
    result = (await _call_daemons(request, [url], "POST", path))[url]
    now = time.monotonic()
    view = next(v for v in registry.snapshot(now) if v.url == url)
    body = daemon_json(view, now, proxy)
    body["daemon_errors"] = {url: result} if isinstance(result, str) else {}
    return _json(body)


async def _call_daemons(
    request: web.Request, urls: list[str], method: str, path: str
) -> dict[str, dict[str, Any] | str]:
    """Each daemon's JSON answer, or a one-line reason it gave none; never raises."""
    session = request.config_dict[PROXY_KEY].session
    token = request.app[AUTH_KEY].token

    async def call(url: str) -> dict[str, Any] | str:
        headers = {"Authorization": f"Bearer {token}"}
        try:
            async with session.request(
                method, url + path, headers=headers, timeout=_DAEMON_CALL_TIMEOUT
            ) as resp:
                if resp.status != 200:
                    return f"HTTP {resp.status}"
                body = await resp.json(loads=orjson.loads, content_type=None)
                return body if isinstance(body, dict) else "answer is not a JSON object"
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__

    results = await asyncio.gather(*(call(u) for u in urls))
    return dict(zip(urls, results))


def _json(body: dict[str, Any]) -> web.Response:
    return web.Response(body=orjson.dumps(body), content_type="application/json")
