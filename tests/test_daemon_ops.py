"""Operator behaviour: disconnects free KV at once, drain, /metrics, /v1/state, roles."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from daemon_helpers import (
    daemon_config,
    engine_stats,
    read_event,
    read_events,
    start,
    wait_for_idle_engine,
)
from edgeinfer.daemon.engine.errors import EngineError
from edgeinfer.daemon.engine.llm_engine import LLMEngine
from edgeinfer.daemon.kv_transfer.stats import TransferStats
from edgeinfer.daemon.metrics import DaemonMetrics
from edgeinfer.daemon.state import METRICS_KEY, STATE_KEY

pytestmark = pytest.mark.asyncio

# Long enough that a request is still generating when the test acts on it mid-stream.
LONG_TOKENS = 400
LONG = {"prompt": "Once upon a time", "max_tokens": LONG_TOKENS, "ignore_eos": True, "stream": True}


ADMIN_TOKEN = "s3cret"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest_asyncio.fixture
async def client(aiohttp_client: Any, checkpoint: Path, llm: LLMEngine) -> Any:
    client = await start(aiohttp_client, daemon_config(checkpoint, admin_token=ADMIN_TOKEN), llm)
    yield client
    assert (await wait_for_idle_engine(client)).kv_blocks_used == 0


async def metric(client: Any, name: str) -> float | None:
    text = await (await client.get("/metrics")).text()
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_disconnect_mid_stream_frees_blocks(client: Any, path: str) -> None:
    body = dict(LONG)
    if path.endswith("chat/completions"):
        body = {**body, "messages": [{"role": "user", "content": "tell me a story"}]}
    before = (await engine_stats(client)).generation_tokens
    resp = await client.post(path, json=body)
    for _ in range(3):
        assert isinstance(await read_event(resp), dict)
    assert (await engine_stats(client)).kv_blocks_used > 0
    resp.close()  # drop the connection with the request mid-generation
    stats = await wait_for_idle_engine(client, timeout=30.0)  # returns once idle
    assert stats.kv_blocks_used == 0 and stats.num_running == 0
    # Aborted, not run to completion: far fewer than max_tokens were generated.
    assert stats.generation_tokens - before < LONG_TOKENS // 2
    assert (
        await metric(client, 'edgeinfer_requests_total{outcome="client_disconnect",tenant=""}') == 1
    )
    assert await metric(client, "edgeinfer_kv_blocks_used") == 0


async def test_disconnect_of_multi_prompt_stream_aborts_all(client: Any) -> None:
    body = {**LONG, "prompt": ["one prompt", "another prompt", "a third one"]}
    resp = await client.post("/v1/completions", json=body)
    await read_event(resp)
    resp.close()
    stats = await wait_for_idle_engine(client, timeout=30.0)  # returns once idle
    assert stats.kv_blocks_used == 0 and stats.num_running == 0


async def test_drain_flow(client: Any) -> None:
    assert (await client.get("/health")).status == 200
    resp = await client.post("/v1/completions", json=LONG)
    first = await read_event(resp)
    assert isinstance(first, dict)

    drained = await client.post("/admin/drain", headers=ADMIN)
    assert drained.status == 200
    state = await drained.json()
    assert state["status"] == "draining" and state["draining"] and state["in_flight"] == 1

    health = await client.get("/health")
    assert health.status == 503 and (await health.json())["status"] == "draining"
    refused = await client.post("/v1/completions", json={"prompt": "hi"})
    assert refused.status == 503
    err = (await refused.json())["error"]
    assert err["code"] == "draining" and "draining" in err["message"]

    # The in-flight request still runs to its end.
    events = [first]
    while (event := await read_event(resp)) is not None:
        events.append(event)
    assert events[-1] == "[DONE]"
    last = events[-2]
    assert isinstance(last, dict) and last["choices"][0]["finish_reason"] == "length"

    state = await (await client.get("/v1/state")).json()
    assert state["status"] == "drained" and state["drained"] and state["in_flight"] == 0
    assert (await client.get("/health")).status == 503

    undrained = await (await client.post("/admin/undrain", headers=ADMIN)).json()
    assert undrained["status"] == "serving"
    assert (await client.get("/health")).status == 200
    assert (await client.post("/v1/completions", json={"prompt": "hi"})).status == 200
    assert await metric(client, 'edgeinfer_requests_total{outcome="rejected",tenant=""}') == 1


async def test_state_reports_load(client: Any) -> None:
    resp = await client.post("/v1/completions", json=LONG)
    await read_event(resp)
    state = await (await client.get("/v1/state")).json()
    assert state["pop"] == "local" and state["role"] == "both" and state["model"] == "tiny-test"
    assert state["running"] == 1 and state["waiting"] == 0
    assert 0 < state["kv_blocks_free"] < state["kv_blocks_total"]
    assert state["max_model_len"] == 512
    resp.close()


METRIC_NAMES = [
    "edgeinfer_request_success_total",
    "edgeinfer_requests_total",
    "edgeinfer_time_to_first_token_seconds_bucket",
    "edgeinfer_inter_token_latency_seconds_bucket",
    "edgeinfer_time_per_output_token_seconds_bucket",
    "edgeinfer_e2e_request_latency_seconds_bucket",
    "edgeinfer_num_requests_running",
    "edgeinfer_num_requests_waiting",
    "edgeinfer_kv_cache_usage_perc",
    "edgeinfer_kv_blocks_used",
    "edgeinfer_kv_blocks_total",
    "edgeinfer_prefix_cache_queries_total",
    "edgeinfer_prefix_cache_hits_total",
    "edgeinfer_prompt_tokens_total",
    "edgeinfer_generation_tokens_total",
    "edgeinfer_num_preemptions_total",
    "edgeinfer_kv_transfer_bytes_total",
    "edgeinfer_kv_transfer_seconds_bucket",
    "edgeinfer_kv_transfer_failures_total",
    "edgeinfer_kv_transfer_dropped_frames_total",
]


async def test_metrics_names_and_values(client: Any) -> None:
    body = {"prompt": "Hello there", "max_tokens": 5, "ignore_eos": True}
    assert (await client.post("/v1/completions", json=body)).status == 200
    metrics = client.app[METRICS_KEY]
    metrics.kv_bytes("received", 4096)
    metrics.kv_transfer_time(0.02)
    metrics.kv_failure("timeout")
    metrics.kv_dropped_frame("checksum")
    resp = await client.get("/metrics")
    assert resp.status == 200 and resp.content_type == "text/plain"
    text = await resp.text()
    missing = [n for n in METRIC_NAMES if f"\n{n}" not in text]
    assert not missing
    assert await metric(client, 'edgeinfer_request_success_total{finished_reason="length"}') == 1
    assert await metric(client, "edgeinfer_kv_blocks_total") == 64
    assert await metric(client, "edgeinfer_kv_cache_usage_perc") == 0
    assert await metric(client, 'edgeinfer_kv_transfer_bytes_total{direction="received"}') == 4096
    assert await metric(client, "edgeinfer_time_to_first_token_seconds_count") == 1
    assert await metric(client, "edgeinfer_inter_token_latency_seconds_count") == 4


async def test_prefill_role_serves_no_api(
    aiohttp_client: Any, checkpoint: Path, llm: LLMEngine
) -> None:
    client = await start(aiohttp_client, daemon_config(checkpoint, role="prefill"), llm)
    assert (await client.get("/health")).status == 200
    assert (await client.get("/metrics")).status == 200
    assert (await (await client.get("/v1/state")).json())["role"] == "prefill"
    for method, path in [
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models"),
    ]:
        resp = await client.request(method, path, json={"prompt": "hi"})
        assert resp.status == 404
        err = (await resp.json())["error"]
        assert err["code"] == "wrong_role" and "prefill" in err["message"]


async def test_unloadable_model_reports_failed(aiohttp_client: Any, tmp_path: Path) -> None:
    client = await start(aiohttp_client, daemon_config(tmp_path / "missing"), None)
    health = await client.get("/health")
    assert health.status == 503 and (await health.json())["status"] == "failed"
    resp = await client.post("/v1/completions", json={"prompt": "hi"})
    assert resp.status == 503 and (await resp.json())["error"]["code"] == "failed"


async def test_admin_token(client: Any) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": ADMIN_TOKEN}):
        resp = await client.post("/admin/drain", headers=headers)
        assert resp.status == 401
        assert (await resp.json())["error"]["code"] == "invalid_admin_token"
    assert client.app[STATE_KEY].phase.value == "serving"
    ok = await client.post("/admin/drain", headers=ADMIN)
    assert ok.status == 200 and (await ok.json())["status"] == "drained"


async def test_admin_is_closed_without_a_token(
    aiohttp_client: Any, checkpoint: Path, llm: LLMEngine
) -> None:
    client = await start(aiohttp_client, daemon_config(checkpoint), llm)
    for path in ("/admin/drain", "/admin/undrain"):
        resp = await client.post(path, headers=ADMIN)
        assert resp.status == 403 and resp.content_type == "application/json"
        assert (await resp.json())["error"]["code"] == "admin_disabled"
    assert (await client.get("/health")).status == 200


async def test_engine_error_mid_stream(client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = client.app[STATE_KEY].runner
    original = runner.run

    async def failing(
        rid: str, ids: Any, params: Any, peer: str | None = None, salt: str | None = None
    ) -> Any:
        async with contextlib.aclosing(original(rid, ids, params, peer, salt)) as outputs:
            async for out in outputs:
                yield out
                raise EngineError("engine failure: boom")

    monkeypatch.setattr(runner, "run", failing)
    events = await read_events(await client.post("/v1/completions", json=LONG))
    # One token chunk, then the error as an event, then [DONE]; no usage, no 200-then-silence.
    assert len(events) == 3 and events[-1] == "[DONE]"
    error = events[1]
    assert isinstance(error, dict) and set(error) == {"error"}
    assert error["error"]["type"] == "server_error" and "boom" in error["error"]["message"]

    resp = await client.post("/v1/completions", json={**LONG, "stream": False})
    assert resp.status == 500
    assert (await resp.json())["error"]["type"] == "server_error"
    assert await metric(client, 'edgeinfer_requests_total{outcome="error",tenant=""}') == 2


async def test_every_kv_transfer_latency_is_counted() -> None:
    metrics = DaemonMetrics()
    stats = TransferStats(observe_latency=metrics.kv_transfer_time)

    def count() -> float:
        metrics.sync_transfer_stats(stats, "sent")  # what a scrape does first
        for line in metrics.render().decode().splitlines():
            if line.startswith("edgeinfer_kv_transfer_seconds_count "):
                return float(line.split()[1])
        raise AssertionError("no kv_transfer_seconds histogram")

    assert count() == 0
    for i in range(5000):  # far more than one scrape interval's worth under load
        stats.record_ok(0.001 * (i % 7))
    assert count() == 5000
    assert count() == 5000  # a second scrape adds nothing
