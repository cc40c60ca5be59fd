"""The router's proxy against fake daemons: placement headers, retries, SSE pass-through.

Retry policy: a placement is retried only when the request never reached the daemon (connect
error) or the daemon refused it with a 503; once a daemon accepted it, a failure reaches the
client and no other daemon sees the request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import pytest_asyncio
import zmq

from edgeinfer.router.app import RouterSetup
from edgeinfer.router.config import load_pops, load_router_config
from edgeinfer.router.openai_api import request_features
from edgeinfer.router.relay import SseFramer, _SilenceTimer
from router_helpers import (
    COMPLETION,
    MODEL,
    TOKEN,
    Cluster,
    FakeDaemon,
    running_router,
    start_cluster,
    write_config,
)


@pytest_asyncio.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with start_cluster(tmp_path) as c:
        yield c


async def read_events(resp: aiohttp.ClientResponse) -> list[bytes]:
    body = await asyncio.wait_for(resp.read(), 5)
    return [e for e in body.split(b"\n\n") if e]


@pytest.mark.asyncio
async def test_json_response_and_placement_headers(cluster: Cluster) -> None:
    async with await cluster.post() as resp:
        assert resp.status == 200
        assert resp.headers["x-edge-decode-pop"] == "fra"
        assert resp.headers["x-edge-prefill-pop"] == "fra"
        assert (await resp.json())["choices"][0]["text"] == "Hello!"
    assert len(cluster.fra.seen) == 1 and not cluster.nyc.seen


@pytest.mark.asyncio
async def test_sse_passes_through_chunk_by_chunk(cluster: Cluster) -> None:
    cluster.fra.gate = asyncio.Event()
    async with await cluster.post({**COMPLETION, "stream": True}) as resp:
        assert resp.status == 200
        assert resp.content_type == "text/event-stream"
        # The daemon holds its second chunk until we have seen the first: nothing is buffered.
        first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
        assert orjson.loads(first.removeprefix(b"data: "))["choices"][0]["text"] == "Hel"
        cluster.fra.gate.set()
        rest = await read_events(resp)
    assert rest[-1] == b"data: [DONE]"
    assert [orjson.loads(e[6:])["choices"][0]["text"] for e in rest[:-1]] == ["lo", "!"]


@pytest.mark.asyncio
async def test_down_daemon_is_retried_not_a_client_error(cluster: Cluster) -> None:
    await cluster.fra.stop_http()  # heartbeats still say it is fine
    async with await cluster.post() as resp:
        assert resp.status == 200
        assert resp.headers["x-edge-decode-pop"] == "nyc"
    assert len(cluster.nyc.seen) == 1


@pytest.mark.asyncio
async def test_a_503_refusal_is_retried(cluster: Cluster) -> None:
    cluster.fra.fail_status = 503
    async with await cluster.post({**COMPLETION, "stream": True}) as resp:
        assert resp.status == 200
        assert resp.headers["x-edge-decode-pop"] == "nyc"
        assert (await read_events(resp))[-1] == b"data: [DONE]"
    assert len(cluster.fra.seen) == 1 and len(cluster.nyc.seen) == 1


@pytest.mark.asyncio
async def test_a_daemon_refusing_the_routers_key_is_never_the_clients_401(
    cluster: Cluster,
) -> None:
    cluster.fra.fail_status = 401  # the router's daemon_api_key_file is wrong for fra
    async with await cluster.post() as resp:
        assert resp.status == 200 and resp.headers["x-edge-decode-pop"] == "nyc"
    cluster.nyc.fail_status = 401
    async with await cluster.post() as resp:
        assert resp.status == 502
        error = (await resp.json())["error"]
    assert error["code"] == "upstream_failed" and "daemon_api_key_file" in error["message"]


@pytest.mark.asyncio
async def test_another_5xx_is_the_daemons_answer_not_retried(cluster: Cluster) -> None:
    cluster.fra.fail_status = 500
    async with await cluster.post() as resp:
        assert resp.status == 500
        assert resp.headers["x-edge-decode-pop"] == "fra"
        assert (await resp.json())["error"]["message"] == "boom"
    assert len(cluster.fra.seen) == 1 and not cluster.nyc.seen


@pytest.mark.asyncio
async def test_a_silent_non_streaming_generation_is_answered_once(tmp_path: Path) -> None:
    # The daemon answers a non-streaming request only when the whole generation is done: a
    # silence far past read_timeout_s is normal there and must not fail or move it.
    async with start_cluster(tmp_path, extra={"read_timeout_s": "0.05"}) as cluster:
        cluster.fra.body_delay_s = 1.0  # 20 windows of silence
        async with await cluster.post() as resp:
            assert resp.status == 200
            assert (await resp.json())["choices"][0]["text"] == "Hello!"
        assert len(cluster.fra.seen) == 1 and not cluster.nyc.seen


@pytest.mark.asyncio
async def test_daemon_dying_after_its_headers_is_not_retried(cluster: Cluster) -> None:
    cluster.fra.die_after_headers = True
    async with await cluster.post() as resp:
        assert resp.status == 200  # the headers were the daemon's; the body is cut short
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()
    assert len(cluster.fra.seen) == 1 and not cluster.nyc.seen


@pytest.mark.asyncio
async def test_daemon_dropping_an_accepted_request_is_a_502_not_a_retry(cluster: Cluster) -> None:
    # The connection was up and the request sent: the daemon may have started, so no retry.
    cluster.fra.drop_request = True
    async with await cluster.post() as resp:
        assert resp.status == 502
        assert resp.content_type == "application/json"
        error = (await resp.json())["error"]
    assert error["code"] == "upstream_failed" and error["type"] == "server_error"
    assert len(cluster.fra.seen) == 1 and not cluster.nyc.seen


@pytest.mark.asyncio
async def test_a_daemon_whose_heartbeats_stop_ends_its_requests(tmp_path: Path) -> None:
    # Its host vanished: the connection stays open and silent, only the heartbeats tell.
    async with start_cluster(tmp_path) as cluster:
        cluster.fra.body_delay_s = 3600.0
        pending = asyncio.ensure_future(cluster.post())
        while not cluster.fra.seen:
            await asyncio.sleep(0.01)
        await cluster.fra.stop_heartbeats()
        async with await asyncio.wait_for(pending, 10) as resp:
            assert resp.status == 502
            error = (await resp.json())["error"]
        assert "heartbeats" in error["message"] and error["code"] == "upstream_failed"
        assert not cluster.nyc.seen


@pytest.mark.asyncio
async def test_request_timeout_bounds_the_whole_request(tmp_path: Path) -> None:
    async with start_cluster(tmp_path, extra={"request_timeout_s": "0.3"}) as cluster:
        cluster.fra.body_delay_s = 3600.0
        async with await cluster.post() as resp:
            assert resp.status == 504
            assert (await resp.json())["error"]["code"] == "timeout"
        cluster.fra.hang = True  # a stream: headers, one event, then silence
        async with await cluster.post({**COMPLETION, "stream": True}) as resp:
            assert resp.status == 200
            events = await read_events(resp)
        assert "request_timeout_s" in orjson.loads(events[1][6:])["error"]["message"]
        assert events[-1] == b"data: [DONE]" and not cluster.nyc.seen


@pytest.mark.asyncio
async def test_a_silent_stream_ends_after_read_timeout(tmp_path: Path) -> None:
    async with start_cluster(tmp_path, extra={"read_timeout_s": "0.2"}) as cluster:
        cluster.fra.hang = True
        async with await cluster.post({**COMPLETION, "stream": True}) as resp:
            events = await read_events(resp)
        assert "read_timeout_s" in orjson.loads(events[1][6:])["error"]["message"]
        assert not cluster.nyc.seen


@pytest.mark.asyncio
async def test_every_placement_failing_passes_the_last_5xx(cluster: Cluster) -> None:
    cluster.fra.fail_status = cluster.nyc.fail_status = 503
    async with await cluster.post() as resp:
        assert resp.status == 503
        assert (await resp.json())["error"]["message"] == "boom"


@pytest.mark.asyncio
async def test_failure_after_first_byte_ends_with_a_clean_error_event(cluster: Cluster) -> None:
    cluster.fra.break_after = 1
    async with await cluster.post({**COMPLETION, "stream": True}) as resp:
        assert resp.status == 200
        events = await read_events(resp)
    assert orjson.loads(events[0][6:])["choices"][0]["text"] == "Hel"
    error = orjson.loads(events[1].removeprefix(b"data: "))["error"]
    assert error["type"] == "server_error" and "mid-stream" in error["message"]
    assert events[2:] == [b"data: [DONE]"]
    assert not cluster.nyc.seen  # no retry once the client has bytes


@pytest.mark.asyncio
async def test_4xx_passes_through_unchanged(cluster: Cluster) -> None:
    async with await cluster.http.post(cluster.url + "/v1/completions", data=b"{nope") as resp:
        assert resp.status == 400
        assert resp.headers["x-fake"] == "1"
        body = await resp.json()
    assert body == {"error": {"message": "body is not JSON", "type": "invalid_request_error"}}
    assert not cluster.nyc.seen


@pytest.mark.asyncio
async def test_client_disconnect_reaches_the_daemon(cluster: Cluster) -> None:
    cluster.fra.hang = True
    resp = await cluster.post({**COMPLETION, "stream": True})
    await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
    resp.close()  # drops the connection mid-stream
    await asyncio.wait_for(cluster.fra.closed.wait(), 5)
    assert cluster.fra.in_flight == 0


@pytest.mark.asyncio
async def test_client_cannot_choose_the_prefill_daemon_or_speak_for_the_router(
    cluster: Cluster,
) -> None:
    headers = {
        "x-edge-prefill": "tcp://evil:1", "x-edge-tenant": "someone-else",
        "x-edge-cache-salt": "their-salt", "Authorization": "Bearer user-key",
        "Cookie": "session=1", "x-custom": "kept",
    }  # fmt: skip
    async with await cluster.post(headers=headers) as resp:
        assert resp.status == 200
    seen = {k.lower(): v for k, v in cluster.fra.seen[0]["headers"].items()}
    assert not any(k.startswith("x-edge-") for k in seen)
    # The client's credentials are its business with the router, never a daemon's.
    assert "authorization" not in seen and "cookie" not in seen
    assert seen["x-custom"] == "kept"  # other end-to-end headers do pass


@pytest.mark.asyncio
async def test_models_and_health(cluster: Cluster) -> None:
    async with cluster.http.get(cluster.url + "/v1/models") as resp:
        assert [m["id"] for m in (await resp.json())["data"]] == [MODEL]
    async with cluster.http.get(cluster.url + "/health") as resp:
        assert resp.status == 200


@pytest.mark.asyncio
async def test_unknown_model_is_404(cluster: Cluster) -> None:
    async with await cluster.post({**COMPLETION, "model": "nope"}) as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["code"] == "model_not_found"


def test_request_features_estimate_prompt_tokens_cheaply() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 9}
    features = request_features(orjson.dumps(chat))
    assert (features.prompt_tokens, features.max_tokens, features.model) == (100, 9, "m")
    assert request_features(b'{"prompt": [1, 2, 3]}').prompt_tokens == 3
    assert request_features(b"not json").model is None


def test_sse_framer_holds_only_an_unfinished_event() -> None:
    framer = SseFramer()
    assert framer.feed(b"data: 1\n\ndata: ") == b"data: 1\n\n"
    assert framer.feed(b"2\n") == b""
    assert framer.feed(b"\n") == b"data: 2\n\n"
    assert framer.feed(b"tail") == b"" and framer.flush() == b"tail"


@pytest.mark.asyncio
async def test_decode_daemon_is_told_where_its_prefill_runs(tmp_path: Path) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    decode, prefill = FakeDaemon("fra", role="decode"), FakeDaemon("nyc", role="prefill")
    for d in (decode, prefill):
        await d.start(ctx)
    (tmp_path / "token").write_text(TOKEN)
    path = write_config(
        tmp_path / "r.toml", {"fra": [decode], "nyc": [prefill]}, tmp_path / "token"
    )
    config = load_router_config(path, env={})
    setup = RouterSetup(config, load_pops(path, "fra"), TOKEN, config_path=path)
    try:
        async with running_router(setup) as (_, url), aiohttp.ClientSession() as http:
            long_prompt = {**COMPLETION, "prompt": "x" * 40_000}
            async with http.post(url + "/v1/completions", json=long_prompt) as resp:
                assert resp.status == 200
                headers = dict(resp.headers)
    finally:
        for d in (decode, prefill):
            await d.close()
        ctx.term()
    assert decode.seen[0]["headers"]["x-edge-prefill"] == prefill.kv_endpoint
    assert (headers["x-edge-prefill-pop"], headers["x-edge-decode-pop"]) == ("nyc", "fra")
    assert not prefill.seen


@pytest.mark.asyncio
async def test_only_waiting_on_the_daemon_counts_as_silence() -> None:
    loop = asyncio.get_running_loop()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(None) as limit:
            silence = _SilenceTimer(loop, limit, 0.05)
            # Writing to a slow client for four windows: not the daemon's silence.
            await asyncio.sleep(0.2)
            assert not silence.fired
            silence.waiting_since = loop.time()
            await asyncio.sleep(10)  # the daemon says nothing: the limit expires
    assert silence.fired
