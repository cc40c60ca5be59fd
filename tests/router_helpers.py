"""Fake edge daemons and a running router for the router/edgectl tests.

A :class:`FakeDaemon` is a small aiohttp app (``/v1/state``, ``/health``, ``/v1/completions``
with SSE, ``/admin/drain``) plus a ZeroMQ PUB socket sending real :class:`Heartbeat` messages,
so the router under test runs its real discovery, heartbeat and placement code; only the model
is missing. Each knob scripts one failure the proxy must survive.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import zmq
from aiohttp import web
from aiohttp.test_utils import TestServer
from multidict import CIMultiDict

from edgeinfer.router.access_log import AccessLog
from edgeinfer.router.app import RouterSetup, create_app
from edgeinfer.router.config import load_pops, load_router_config
from edgeinfer.shared.heartbeat import Heartbeat

MODEL = "fake-model"
TOKEN = "s3cret-admin-token"
# Frankfurt (the router's own PoP) and New York: far enough apart that a client located at
# the router is always placed in Frankfurt first.
COORDS = {"fra": (50.11, 8.68), "nyc": (40.71, -74.01)}
HEARTBEAT_S = 0.05
COMPLETION = {"model": MODEL, "prompt": "Say hello", "max_tokens": 8}


@dataclass
class FakeDaemon:
    pop: str
    role: str = "both"
    chunks: list[str] = field(default_factory=lambda: ["Hel", "lo", "!"])
    chunk_delay_s: float = 0.0
    fail_status: int | None = None  # answer every completion with this 5xx
    break_after: int | None = None  # abort the connection after this many chunks
    body_delay_s: float = 0.0  # a non-streaming answer comes this late (a long generation)
    drop_request: bool = False  # read the request, then close the connection unanswered
    die_after_headers: bool = False  # a non-streaming answer: 200 headers, then a cut
    gate: asyncio.Event | None = None  # the second chunk waits for it
    hang: bool = False  # after the first chunk, never finish
    draining: bool = False
    seen: list[dict[str, Any]] = field(default_factory=list)  # every completion request
    state_headers: list[CIMultiDict[str]] = field(default_factory=list)  # of each /v1/state
    closed: asyncio.Event = field(default_factory=asyncio.Event)  # a handler was cancelled
    admin_calls: list[str] = field(default_factory=list)
    in_flight: int = 0
    server: TestServer | None = None
    url: str = ""
    kv_endpoint: str = ""
    heartbeat_endpoint: str = ""

    async def start(self, ctx: zmq.Context[Any]) -> None:
        app = web.Application()
        app.router.add_get("/v1/state", self._state)
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/admin/drain", self._admin)
        app.router.add_post("/admin/undrain", self._admin)
        self.server = TestServer(app, host="127.0.0.1")
        await self.server.start_server()  # TestServer cancels handlers on disconnect
        self.url = f"http://127.0.0.1:{self.server.port}"
        self.kv_endpoint = f"tcp://127.0.0.1:{self.server.port + 1}"  # named, never dialled
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        port = self._pub.bind_to_random_port("tcp://127.0.0.1")
        self.heartbeat_endpoint = f"tcp://127.0.0.1:{port}"
        self._started = time.time()
        self._beats = asyncio.create_task(self._publish())

    async def stop_heartbeats(self) -> None:
        """The daemon's host goes silent: no heartbeats, and its connections stay open."""
        self._beats.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._beats

    async def stop_http(self) -> None:
        """The daemon's HTTP side dies; its heartbeats keep claiming it is fine."""
        if self.server is not None:
            await self.server.close()

    async def close(self) -> None:
        await self.stop_heartbeats()
        self._pub.close()
        await self.stop_http()

    def heartbeat(self, seq: int) -> Heartbeat:
        return Heartbeat(
            daemon_id=self.url, pop=self.pop, role=self.role, model=MODEL,  # type: ignore[arg-type]
            kv_endpoint=self.kv_endpoint, running=self.in_flight, waiting=0,
            kv_blocks_free=750, kv_blocks_total=1000, block_size=16,
            prefill_tokens_per_s=8000.0, decode_tokens_per_s=400.0, ttft_p50_s=0.042,
            itl_p50_s=0.02, queued_prefill_tokens=0, draining=self.draining,
            drained=self.draining and self.in_flight == 0, in_flight=self.in_flight,
            kv_bytes_per_token=23040, local_prefill_threshold=512, prefill_chunk_tokens=2048,
            tokenizer_id="fake", prefix_caching=False, kv_event_seq=0, seq=seq,
            started_at=self._started, sent_at=time.time(),
        )  # fmt: skip

    async def _publish(self) -> None:
        seq = 0
        while True:
            self._pub.send(self.heartbeat(seq).encode(), zmq.NOBLOCK)
            seq += 1
            await asyncio.sleep(HEARTBEAT_S)

    async def _state(self, request: web.Request) -> web.Response:
        if request.path == "/v1/state":
            self.state_headers.append(CIMultiDict(request.headers))
        return web.json_response(
            {"pop": self.pop, "role": self.role, "model": MODEL, "kv_endpoint": self.kv_endpoint,
             "heartbeat_endpoint": self.heartbeat_endpoint, "in_flight": self.in_flight,
             "draining": self.draining, "status": "serving"}
        )  # fmt: skip

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "serving"})

    async def _admin(self, request: web.Request) -> web.Response:
        self.admin_calls.append(request.path)
        self.draining = request.path.endswith("/drain")
        return await self._state(request)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            error = {"message": "body is not JSON", "type": "invalid_request_error"}
            return web.json_response({"error": error}, status=400, headers={"x-fake": "1"})
        headers = CIMultiDict(request.headers)  # looked up as HTTP does: case-insensitively
        self.seen.append({"body": body, "headers": headers, "at": time.monotonic()})
        if self.fail_status is not None:
            return web.json_response({"error": {"message": "boom"}}, status=self.fail_status)
        if self.draining:
            return web.json_response({"error": {"message": "draining"}}, status=503)
        if self.drop_request:
            assert request.transport is not None
            request.transport.abort()
            return web.Response()
        self.in_flight += 1
        try:
            if not body.get("stream"):
                return await self._whole(request)
            return await self._stream(request)
        except asyncio.CancelledError:
            self.closed.set()
            raise
        finally:
            self.in_flight -= 1

    async def _whole(self, request: web.Request) -> web.StreamResponse:
        if self.die_after_headers:
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            resp.content_length = 1000
            await resp.prepare(request)
            await resp.write(b'{"object": "text_')
            assert request.transport is not None
            request.transport.abort()
            return resp
        await asyncio.sleep(self.body_delay_s)
        text = "".join(self.chunks)
        return web.json_response({"object": "text_completion", "choices": [{"text": text}]})

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Cache-Control": "no-cache"})
        resp.content_type = "text/event-stream"
        await resp.prepare(request)
        for i, text in enumerate(self.chunks):
            if i == self.break_after:
                assert request.transport is not None
                request.transport.abort()
                return resp
            if i == 1 and self.gate is not None:
                await self.gate.wait()
            if i == 1 and self.hang:
                await asyncio.Event().wait()
            await asyncio.sleep(self.chunk_delay_s)
            await resp.write(sse({"choices": [{"index": 0, "text": text}]}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


def write_config(
    path: Path,
    daemons: dict[str, list[FakeDaemon]],
    token_file: Path,
    extra: dict[str, str] | None = None,
) -> Path:
    """The router's TOML; ``extra`` adds ``[router]`` keys (values already in TOML syntax)."""
    settings = {
        "here": '"fra"',
        "admin_token_file": f'"{token_file}"',
        # The fakes beat every HEARTBEAT_S; the router calls a daemon lost after 3 periods of
        # this (1.5 s), longer than a stall of the test process on a loaded host (0.6 s once
        # cut a request with "the daemon stopped sending heartbeats").
        "heartbeat_interval_s": str(HEARTBEAT_S * 10),
        "discovery_interval_s": "0.05",
        "request_timeout_s": "30.0",
        **(extra or {}),
    }
    lines = ["[router]", *(f"{k} = {v}" for k, v in settings.items()), ""]
    for pop, members in daemons.items():
        lat, lon = COORDS[pop]
        urls = ", ".join(f'"{d.url}"' for d in members)
        lines += [
            "[[pop]]",
            f'name = "{pop}"',
            f"lat = {lat}",
            f"lon = {lon}",
            f"daemons = [{urls}]",
            "",
        ]
    path.write_text("\n".join(lines))
    return path


@contextlib.asynccontextmanager
async def running_router(setup: RouterSetup) -> AsyncIterator[tuple[web.Application, str]]:
    """The router app on a free port, once every configured daemon is placeable."""
    app = create_app(setup)
    server = TestServer(app, host="127.0.0.1")
    # handler_cancellation and the access line, like make_runner
    await server.start_server(shutdown_timeout=5.0, access_log_class=AccessLog)
    url = f"http://127.0.0.1:{server.port}"
    try:
        await wait_placeable(app, sum(len(p.daemons) for p in setup.pops))
        yield app, url
    finally:
        await server.close()


async def wait_placeable(app: web.Application, count: int, timeout_s: float = 10.0) -> None:
    from edgeinfer.router.app import REGISTRY_KEY

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        views = app[REGISTRY_KEY].snapshot(time.monotonic())
        if sum(v.available for v in views) >= count:
            return
        await asyncio.sleep(0.02)
    raise TimeoutError(f"fewer than {count} daemons became placeable in {timeout_s}s")


@dataclass
class Cluster:
    """Two fake daemons (``fra``, the router's PoP, and ``nyc``) behind a running router."""

    fra: FakeDaemon
    nyc: FakeDaemon
    app: web.Application
    url: str
    http: aiohttp.ClientSession
    config_path: Path

    async def post(self, body: Any = None, **kwargs: Any) -> aiohttp.ClientResponse:
        data = orjson.dumps(body if body is not None else COMPLETION)
        return await self.http.post(self.url + "/v1/completions", data=data, **kwargs)


@contextlib.asynccontextmanager
async def start_cluster(
    tmp_path: Path, token: str | None = TOKEN, extra: dict[str, str] | None = None
) -> AsyncIterator[Cluster]:
    ctx: zmq.Context[Any] = zmq.Context()
    fra, nyc = FakeDaemon("fra"), FakeDaemon("nyc")
    for d in (fra, nyc):
        await d.start(ctx)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    daemons = {"fra": [fra], "nyc": [nyc]}
    path = write_config(tmp_path / "router.toml", daemons, token_file, extra)
    config = load_router_config(path, env={})
    setup = RouterSetup(config, load_pops(path, config.here), token, config_path=path)
    try:
        async with running_router(setup) as (app, url), aiohttp.ClientSession() as http:
            yield Cluster(fra, nyc, app, url, http, path)
    finally:
        for d in (fra, nyc):
            await d.close()
        ctx.term()
