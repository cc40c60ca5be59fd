"""The tenant Gate in front of a tiny aiohttp app: keys, models, request/token/stream limits.

The app does what the router's proxy does with the Gate: admit, answer a rejection as its
OpenAI error, send the admission's headers, feed every piece of the answer to ``observe`` and
``finish`` at the end. Its answers are scripted per request (``pieces``), and a stream can be
held open on an event to test what happens while it is in flight.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from edgeinfer.router.config import RouterConfig
from edgeinfer.router.gate import FLUSH_TOKENS, GATE_KEY, Gate, GateRejection, duration
from edgeinfer.router.tenants import TenantKey, key_digest, keys_file_toml

ACME, BETA, TINY = "ei-acme-key", "ei-beta-key", "tiny"
Client = TestClient[web.Request, web.Application]


@dataclass
class Script:
    """What the app answers; ``hold`` keeps the next stream open after its first piece."""

    pieces: list[bytes] = field(default_factory=list)
    sse: bool = True
    hold: asyncio.Event | None = None
    started: asyncio.Event = field(default_factory=asyncio.Event)
    upstream: list[dict[str, str]] = field(default_factory=list)


SCRIPT = web.AppKey("script", Script)


async def handler(request: web.Request) -> web.StreamResponse:
    gate, script = request.app[GATE_KEY], request.app[SCRIPT]
    body = orjson.loads(await request.read()) if request.can_read_body else {}
    try:
        admission = await gate.admit(request, body.get("model"), body.get("prompt_tokens", 0))
    except GateRejection as rejection:
        return web.json_response(rejection.body, status=rejection.status, headers=rejection.headers)
    try:
        script.upstream.append(admission.upstream_headers())
        kind = "text/event-stream" if script.sse else "application/json"
        resp = web.StreamResponse(headers={**admission.response_headers(), "Content-Type": kind})
        await resp.prepare(request)
        hold, script.hold = script.hold, None
        for i, piece in enumerate(script.pieces):
            admission.observe(piece, script.sse)
            await resp.write(piece)
            if i == 0:
                script.started.set()
                if hold is not None:
                    await hold.wait()
        await resp.write_eof()
        return resp
    finally:
        await admission.finish()
        await admission.finish()  # idempotent: a second call changes nothing


def keys(*entries: TenantKey) -> str:
    return keys_file_toml(entries, "# test keys\n")


def acme(**limits: Any) -> TenantKey:
    return TenantKey(tenant="acme", sha256=key_digest(ACME), id="k_acme", **limits)


def beta(**limits: Any) -> TenantKey:
    return TenantKey(tenant="beta", sha256=key_digest(BETA), id="k_beta", **limits)


@dataclass
class World:
    client: Client
    gate: Gate
    script: Script
    keys_file: Path

    async def post(self, key: str | None = ACME, **body: Any) -> tuple[int, dict[str, str], Any]:
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        return await self.call("POST", headers, {"model": TINY, **body})

    async def call(
        self, method: str, headers: dict[str, str], body: dict[str, Any] | None = None
    ) -> tuple[int, dict[str, str], Any]:
        data = orjson.dumps(body) if body is not None else None
        async with self.client.request(method, "/v1/x", data=data, headers=headers) as resp:
            raw = await resp.read()
            is_json = resp.content_type == "application/json"
            return resp.status, dict(resp.headers), orjson.loads(raw) if is_json else raw

    async def tokens_used(self, tenant: str = "acme", limit: int = 1000) -> int:
        return (await self.gate._limits.window("tokens", tenant, limit)).used  # type: ignore[union-attr]


Factory = Callable[..., Awaitable[World]]


@pytest_asyncio.fixture
async def world(tmp_path: Path) -> AsyncIterator[Factory]:
    made: list[World] = []

    async def make(text: str | None, **config: Any) -> World:
        path = tmp_path / "keys.toml"
        if text is not None:
            path.write_text(text)
        cfg = RouterConfig(api_keys_file=path if text is not None else None, **config)
        gate = await Gate.create(cfg)
        app = web.Application()
        app[GATE_KEY] = gate
        app[SCRIPT] = script = Script(pieces=[sse_chunk("Hi")])
        app.router.add_route("*", "/v1/x", handler)
        client: Client = TestClient(TestServer(app))
        await client.start_server()
        made.append(w := World(client, gate, script, path))
        return w

    yield make
    for w in made:
        await w.client.close()
        await w.gate.close()


def sse_chunk(text: str, **extra: Any) -> bytes:
    event = {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": text}}],
    }
    return b"data: " + orjson.dumps({**event, **extra}) + b"\n\n"


def assert_error(body: Any, code: str, type: str = "invalid_request_error") -> str:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert (body["error"]["code"], body["error"]["type"]) == (code, type)
    return str(body["error"]["message"])


# ---- without a keys file ---------------------------------------------------------------------


@pytest.mark.asyncio
async def test_without_keys_everyone_is_admitted_without_headers(world: Factory) -> None:
    w = await world(None)
    status, headers, _ = await w.post(key=None)
    assert status == 200
    assert not [h for h in headers if h.lower().startswith("x-ratelimit")]
    assert w.script.upstream == [{}]


# ---- authentication --------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ({}, "You didn't provide an API key."),
        ({"Authorization": ""}, "You didn't provide an API key."),
        ({"Authorization": f"Basic {ACME}"}, "The Authorization header must be 'Bearer YOUR_KEY'."),
        ({"Authorization": "Bearer "}, "The Authorization header must be 'Bearer YOUR_KEY'."),
        ({"Authorization": "Bearer ei-wrong-key"}, "Incorrect API key provided."),
        ({"Authorization": f"Bearer {key_digest(ACME)}"}, "Incorrect API key provided."),
    ],
    ids=["none", "empty", "basic", "bearer-alone", "wrong", "the-digest"],
)
async def test_no_valid_key_is_401(world: Factory, headers: dict[str, str], message: str) -> None:
    w = await world(keys(acme()))
    status, resp_headers, body = await w.call("POST", headers, {"model": TINY})
    assert status == 401
    assert assert_error(body, "invalid_api_key").startswith(message)
    assert "ei-wrong-key" not in orjson.dumps(body).decode()  # never echoed
    assert resp_headers["WWW-Authenticate"].startswith("Bearer")
    assert w.script.upstream == []


@pytest.mark.asyncio
async def test_a_known_key_names_its_tenant_to_the_daemon(world: Factory) -> None:
    w = await world(keys(acme(), beta()))
    assert (await w.post(ACME))[0] == 200
    assert (await w.post(BETA))[0] == 200
    assert (await w.post(f"  {ACME}  "))[0] == 200  # surrounding blanks are not part of it
    assert w.script.upstream == [
        {"x-edge-tenant": "acme", "x-edge-cache-salt": "acme"},
        {"x-edge-tenant": "beta", "x-edge-cache-salt": "beta"},
        {"x-edge-tenant": "acme", "x-edge-cache-salt": "acme"},
    ]


@pytest.mark.asyncio
async def test_a_shared_prefix_cache_sends_no_salt(world: Factory) -> None:
    w = await world(keys(acme()), share_prefix_cache_across_tenants=True)
    assert (await w.post())[0] == 200
    assert w.script.upstream == [{"x-edge-tenant": "acme"}]


# ---- models ----------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_model_the_key_may_not_use_is_403(world: Factory) -> None:
    w = await world(keys(acme(models=(TINY,), requests_per_minute=10)))
    status, headers, body = await w.post(model="big")
    assert status == 403
    message = assert_error(body, "model_not_allowed")
    assert message == "This request asks for the model 'big'; this API key may use only 'tiny'."
    assert body["error"]["param"] == "model"
    assert headers["x-ratelimit-remaining-requests"] == "10"  # refused before counting
    status, _, body = await w.call("POST", {"Authorization": f"Bearer {ACME}"}, {})
    assert status == 403
    assert assert_error(body, "model_not_allowed").startswith("This request names no model")
    # A GET (/v1/models) names no model and needs none; the allowed model passes.
    assert (await w.call("GET", {"Authorization": f"Bearer {ACME}"}))[0] == 200
    assert (await w.post(model=TINY))[0] == 200


# ---- requests per minute ---------------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_third_request_of_a_two_rpm_key_is_429_with_retry_after(world: Factory) -> None:
    w = await world(keys(acme(requests_per_minute=2), beta(requests_per_minute=2)))
    first = await w.post()
    assert first[0] == 200
    assert first[1]["x-ratelimit-limit-requests"] == "2"
    assert first[1]["x-ratelimit-remaining-requests"] == "1"
    assert first[1]["x-ratelimit-reset-requests"].endswith("s")
    assert "x-ratelimit-limit-tokens" not in first[1]  # the key has no token limit
    assert (await w.post())[1]["x-ratelimit-remaining-requests"] == "0"
    status, headers, body = await w.post()
    assert status == 429
    message = assert_error(body, "rate_limit_exceeded", type="requests")
    assert message.startswith(
        "Rate limit reached for requests per minute (RPM) of tenant 'acme': limit 2, used 2"
    )
    retry = int(headers["Retry-After"])
    assert 1 <= retry <= 120
    assert headers["x-ratelimit-limit-requests"] == "2"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert len(w.script.upstream) == 2
    assert (await w.post(BETA))[0] == 200  # another tenant's window is its own


# ---- tokens per minute -----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_streamed_tokens_count_against_the_window(world: Factory) -> None:
    w = await world(keys(acme(tokens_per_minute=1000)))
    w.script.pieces = [sse_chunk(f"t{i}") for i in range(50)] + [b"data: [DONE]\n\n"]
    status, headers, _ = await w.post(prompt_tokens=100)
    assert status == 200
    assert headers["x-ratelimit-limit-tokens"] == "1000"
    assert headers["x-ratelimit-remaining-tokens"] == "900"  # the prompt, at admission
    assert await w.tokens_used() == 150  # + one token per content delta
    # 850 left: a prompt of 900 does not fit, and waits for the window to slide.
    status, headers, body = await w.post(prompt_tokens=900)
    assert status == 429
    assert assert_error(body, "rate_limit_exceeded", type="tokens").startswith(
        "Rate limit reached for tokens per minute (TPM) of tenant 'acme': limit 1000, used 150, "
        "requested 900."
    )
    assert int(headers["Retry-After"]) >= 1
    assert headers["x-ratelimit-remaining-tokens"] == "850"


@pytest.mark.asyncio
async def test_a_prompt_larger_than_the_whole_limit_is_refused(world: Factory) -> None:
    w = await world(keys(acme(tokens_per_minute=1000)))
    status, headers, body = await w.post(prompt_tokens=1001)
    assert status == 429
    assert assert_error(body, "rate_limit_exceeded", type="tokens").startswith(
        "Request too large for tenant 'acme': about 1001 prompt tokens"
    )
    assert int(headers["Retry-After"]) >= 1


@pytest.mark.asyncio
async def test_the_answers_usage_settles_the_count(world: Factory) -> None:
    w = await world(keys(acme(tokens_per_minute=1000)))
    usage = {"prompt_tokens": 30, "completion_tokens": 40, "total_tokens": 70}
    # Streaming with include_usage: 2 deltas seen, the usage chunk says 70 in all.
    w.script.pieces = [sse_chunk("a"), sse_chunk("b"), sse_chunk("", usage=usage, choices=[])]
    assert (await w.post(prompt_tokens=10))[0] == 200
    assert await w.tokens_used() == 70
    # Non-streaming: the JSON body's usage, the body split anywhere.
    w.script.sse = False
    body = orjson.dumps({"choices": [{"text": "x" * 50}], "usage": usage})
    w.script.pieces = [body[:7], body[7:60], body[60:]]
    assert (await w.post(prompt_tokens=10))[0] == 200
    assert await w.tokens_used() == 140
    # An over-estimated prompt is not given back: the window keeps the larger count.
    assert (await w.post(prompt_tokens=500))[0] == 200
    assert await w.tokens_used() == 640


@pytest.mark.asyncio
async def test_tokens_count_while_the_stream_is_still_running(world: Factory) -> None:
    w = await world(keys(acme(tokens_per_minute=1000)))
    w.script.hold = hold = asyncio.Event()
    # Events cut at odd places: the gate reassembles lines itself.
    stream = b"".join(sse_chunk(f"t{i}") for i in range(FLUSH_TOKENS + 8))
    w.script.pieces = [stream[:5], stream[5:-3], stream[-3:]]
    request = asyncio.create_task(w.post(prompt_tokens=10))
    await asyncio.wait_for(w.script.started.wait(), 10)
    # The first piece is the unfinished first event: nothing counted yet past the prompt.
    assert await w.tokens_used() == 10
    hold.set()
    assert (await asyncio.wait_for(request, 10))[0] == 200
    assert await w.tokens_used() == 10 + FLUSH_TOKENS + 8


@pytest.mark.asyncio
async def test_a_batch_of_tokens_is_hit_before_the_stream_ends(world: Factory) -> None:
    w = await world(keys(acme(tokens_per_minute=1000)))
    w.script.hold = hold = asyncio.Event()
    w.script.pieces = [b"".join(sse_chunk("t") for _ in range(FLUSH_TOKENS)), sse_chunk("end")]
    request = asyncio.create_task(w.post(prompt_tokens=10))
    await asyncio.wait_for(w.script.started.wait(), 10)
    for _ in range(100):  # the batch is hit by a task of its own: let it run
        if await w.tokens_used() == 10 + FLUSH_TOKENS:
            break
        await asyncio.sleep(0)
    assert await w.tokens_used() == 10 + FLUSH_TOKENS
    hold.set()
    assert (await asyncio.wait_for(request, 10))[0] == 200
    assert await w.tokens_used() == 10 + FLUSH_TOKENS + 1


# ---- streams in flight -----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_max_concurrent_refuses_a_second_stream_until_the_first_ends(world: Factory) -> None:
    w = await world(keys(acme(max_concurrent=1, requests_per_minute=100), beta()))
    w.script.hold = hold = asyncio.Event()
    w.script.pieces = [sse_chunk("a"), sse_chunk("b")]
    first = asyncio.create_task(w.post())
    await asyncio.wait_for(w.script.started.wait(), 10)
    status, headers, body = await w.post()
    assert status == 429
    assert assert_error(body, "concurrency_limit_exceeded", type="requests").startswith(
        "Too many concurrent requests for tenant 'acme': at most 1 in flight."
    )
    assert headers["Retry-After"] == "1"
    assert headers["x-ratelimit-remaining-requests"] == "99"  # the refusal took nothing
    assert (await w.post(BETA))[0] == 200  # other tenants are not held up
    hold.set()
    assert (await asyncio.wait_for(first, 10))[0] == 200
    assert (await w.post())[0] == 200
    assert w.gate._in_flight == {}


# ---- reload ----------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_revoked_key_is_refused_at_once_and_its_stream_finishes(world: Factory) -> None:
    w = await world(keys(acme(max_concurrent=2), beta()))
    w.script.hold = hold = asyncio.Event()
    w.script.pieces = [sse_chunk("a"), sse_chunk("b"), b"data: [DONE]\n\n"]
    stream = asyncio.create_task(w.post())
    await asyncio.wait_for(w.script.started.wait(), 10)
    w.keys_file.write_text(keys(beta()))
    w.gate.reload()
    status, _, body = await w.post()
    assert status == 401
    assert_error(body, "invalid_api_key")
    hold.set()
    status, _, raw = await asyncio.wait_for(stream, 10)
    assert status == 200 and raw.endswith(b"data: [DONE]\n\n")
    assert w.gate._in_flight == {}  # the slot of a revoked key's stream is freed too
    assert (await w.post(BETA))[0] == 200


@pytest.mark.asyncio
async def test_a_bad_file_on_reload_keeps_the_keys(
    world: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    w = await world(keys(acme()))
    w.keys_file.write_text(keys(acme()) + "oops = 1\n")
    w.gate.reload()
    assert "SIGHUP: keeping the current API keys: unknown key 'oops' in" in caplog.text
    assert (await w.post())[0] == 200
    w.keys_file.write_text(keys(acme(), beta()))
    w.gate.reload()
    assert (await w.post(BETA))[0] == 200


@pytest.mark.asyncio
async def test_an_empty_keys_file_refuses_everyone(
    world: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    w = await world("")
    assert (await w.post())[0] == 401
    assert "holds no keys: every request is refused" in caplog.text


# ---- formats ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.0, "0ms"), (0.1201, "121ms"), (1.0, "1s"), (17.5, "17.5s"), (59.9985, "59.999s"), (59.9994, "1m0s"),
     (60.0, "1m0s"), (360.0, "6m0s"), (61.25, "1m1.25s"), (-3.0, "0ms")],
)  # fmt: skip
def test_reset_durations_read_like_openais(seconds: float, text: str) -> None:
    assert duration(seconds) == text


def test_rejection_bodies_are_openai_errors() -> None:
    r = GateRejection(429, "slow down", type="tokens", code="rate_limit_exceeded")
    assert r.body == {
        "error": {
            "message": "slow down",
            "type": "tokens",
            "param": None,
            "code": "rate_limit_exceeded",
        }
    }
    assert (r.status, r.headers, str(r)) == (429, {}, "slow down")
