"""The least an aiohttp proxy can do (not a test): what ``router_latency.py`` measures a router
against besides the direct path.

It forwards ``POST /v1/chat/completions`` to one upstream over a kept-alive connection and
streams the answer back chunk by chunk, as the router's relay does, with no placement, no
access log, no metrics and no API keys: the latency any aiohttp proxy adds on this host. The
router's added latency minus this one is what the router itself costs.

    .venv/bin/python bench/floor_proxy.py --port 8090 --upstream http://127.0.0.1:8080
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

import aiohttp
import uvloop
from aiohttp import web

UPSTREAM = web.AppKey("upstream", str)
SESSION = web.AppKey("session", aiohttp.ClientSession)


async def forward(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    url = request.app[UPSTREAM] + request.path
    headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
    async with request.app[SESSION].post(url, data=body, headers=headers) as upstream:
        resp = web.StreamResponse(status=upstream.status)
        resp.content_type = upstream.content_type
        await resp.prepare(request)
        while raw := await upstream.content.readany():
            await resp.write(raw)
        await resp.write_eof()
        return resp


async def health(_: web.Request) -> web.Response:
    return web.Response(text="ok")


def make_app(upstream: str) -> web.Application:
    app = web.Application()
    app[UPSTREAM] = upstream.rstrip("/")

    async def session(app: web.Application) -> AsyncIterator[None]:
        app[SESSION] = aiohttp.ClientSession()
        yield
        await app[SESSION].close()

    app.cleanup_ctx.append(session)
    app.router.add_post("/v1/chat/completions", forward)
    app.router.add_get("/health", health)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="the daemon's base URL")
    args = parser.parse_args()
    web.run_app(
        make_app(args.upstream), host="127.0.0.1", port=args.port, access_log=None,
        loop=uvloop.new_event_loop(), print=None,
    )  # fmt: skip


if __name__ == "__main__":
    main()
