"""A fake edge daemon for router benchmarks: a real daemon's identity and heartbeats, no model.

``/v1/state`` and ZeroMQ heartbeats make a real ``edge-router`` discover and place on it;
``/v1/chat/completions`` streams ``--chunks`` chat chunks (real-sized SSE events) as fast as
the socket takes them, so a request's latency is all HTTP and proxy, nothing else;
``/v1/tokenizer`` serves the built-in model's tokenizer when it is in the cache, so the router
tokenises each request as it would for a real daemon.

    .venv/bin/python bench/fake_daemon.py --port 9000 --heartbeat-port 9001 [--chunks 64]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import orjson
import uvloop
import zmq
import zmq.asyncio
from aiohttp import web

from edgeinfer.shared.heartbeat import Heartbeat
from router_prefix import MODEL_DIR, tokenizer_description

MODEL = "bench-model"
POP = "bench"
HEARTBEAT_S = 0.5


def chunk_event(i: int) -> bytes:
    """One SSE chat chunk the size of a daemon's (id, model, one token of text)."""
    body = {"id": "chatcmpl-0123456789abcdef0123456789abcdef", "object": "chat.completion.chunk",
            "created": 1_700_000_000, "model": MODEL,
            "choices": [{"index": 0, "delta": {"content": f" tok{i}"}, "finish_reason": None}]}  # fmt: skip
    return b"data: " + orjson.dumps(body) + b"\n\n"


class FakeDaemon:
    def __init__(self, port: int, heartbeat_port: int, chunks: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.heartbeat_endpoint = f"tcp://127.0.0.1:{heartbeat_port}"
        self.port = port
        self.events = [chunk_event(i) for i in range(chunks)] + [b"data: [DONE]\n\n"]
        self.started_at = time.time()

    def state(self) -> dict[str, object]:
        return {"pop": POP, "role": "both", "model": MODEL, "kv_endpoint": None,
                "heartbeat_endpoint": self.heartbeat_endpoint, "status": "serving",
                "in_flight": 0, "draining": False}  # fmt: skip

    def heartbeat(self, seq: int) -> Heartbeat:
        return Heartbeat(
            daemon_id=self.url, pop=POP, role="both", model=MODEL, kv_endpoint=None, running=0,
            waiting=0, kv_blocks_free=1000, kv_blocks_total=1000, block_size=16,
            prefill_tokens_per_s=10_000.0, decode_tokens_per_s=1_000.0, ttft_p50_s=0.01,
            itl_p50_s=0.01, queued_prefill_tokens=0, draining=False, drained=False, in_flight=0,
            kv_bytes_per_token=23040, local_prefill_threshold=512, prefill_chunk_tokens=2048,
            tokenizer_id="fake", prefix_caching=False, kv_event_seq=0, seq=seq, started_at=self.started_at, sent_at=time.time(),
        )  # fmt: skip

    async def handle_state(self, request: web.Request) -> web.Response:
        return web.json_response(self.state())

    async def handle_tokenizer(self, request: web.Request) -> web.Response:
        description = tokenizer_description(MODEL_DIR, "fake")
        if description is None:
            raise web.HTTPNotFound()
        return web.json_response(description)

    async def handle_health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "serving"})

    async def handle_chat(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Cache-Control": "no-cache"})
        resp.content_type = "text/event-stream"
        await resp.prepare(request)
        for event in self.events:  # one write per event, as the real daemon does per token
            await resp.write(event)
        await resp.write_eof()
        return resp

    async def publish(self, ctx: zmq.asyncio.Context) -> None:
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(self.heartbeat_endpoint)
        seq = 0
        while True:
            await pub.send(self.heartbeat(seq).encode())
            seq += 1
            await asyncio.sleep(HEARTBEAT_S)

    async def serve(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/state", self.handle_state)
        app.router.add_get("/health", self.handle_health)
        app.router.add_post("/v1/chat/completions", self.handle_chat)
        app.router.add_get("/v1/tokenizer", self.handle_tokenizer)
        runner = web.AppRunner(app, access_log=None)  # a real daemon logs; this one measures
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        ctx = zmq.asyncio.Context()
        try:
            await self.publish(ctx)
        finally:
            ctx.destroy(linger=0)
            await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--heartbeat-port", type=int, required=True)
    parser.add_argument("--chunks", type=int, default=64)
    args = parser.parse_args()
    uvloop.run(FakeDaemon(args.port, args.heartbeat_port, args.chunks).serve())


if __name__ == "__main__":
    main()
