"""The daemon's api_key, request ids and tenants (issue 16, the daemon side)."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest

from daemon_helpers import build_checkpoint, daemon_config, load_engine, read_events, start
from edgeinfer.daemon.engine.llm_engine import LLMEngine
from edgeinfer.shared.request_ids import RequestIdFilter

pytestmark = pytest.mark.asyncio

KEY = "the-routers-daemon-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
COMPLETION = {"prompt": "Hello there", "max_tokens": 3, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("daemon_auth"))


@pytest.fixture(scope="module")
def llm(checkpoint: Path) -> LLMEngine:
    return load_engine(checkpoint)


async def keyed(aiohttp_client: Any, checkpoint: Path, llm: LLMEngine, **config: Any) -> Any:
    return await start(aiohttp_client, daemon_config(checkpoint, api_key=KEY, **config), llm)


async def metric(client: Any, sample: str) -> float | None:
    for line in (await (await client.get("/metrics")).text()).splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong-key-that-must-not-be-echoed"},
        {"Authorization": KEY},  # no scheme
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": f"Bearer {KEY}x"},
        {"Authorization": f"Bearer {KEY[:-1]}"},
    ],
    ids=["none", "wrong", "no-scheme", "basic", "longer", "shorter"],
)
async def test_every_api_route_needs_the_key(
    aiohttp_client: Any, checkpoint: Path, llm: LLMEngine, headers: dict[str, str]
) -> None:
    client = await keyed(aiohttp_client, checkpoint, llm)
    for method, path, body in [
        ("POST", "/v1/completions", COMPLETION),
        ("POST", "/v1/chat/completions", CHAT),
        ("GET", "/v1/models", None),
        ("GET", "/v1/nothing", None),
    ]:
        resp = await client.request(method, path, json=body, headers=headers)
        assert resp.status == 401, path
        assert resp.content_type == "application/json"
        error = (await resp.json())["error"]
        assert error["code"] == "invalid_api_key"
        assert set(error) == {"message", "type", "param", "code"}
        assert "wrong-key" not in error["message"] and KEY not in error["message"]
    assert (await metric(client, 'edgeinfer_requests_total{outcome="success",tenant=""}')) is None


async def test_key_opens_the_api_and_ops_routes_stay_open(
    aiohttp_client: Any, checkpoint: Path, llm: LLMEngine
) -> None:
    client = await keyed(aiohttp_client, checkpoint, llm)
    for path, body in [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)]:
        assert (await client.post(path, json=body, headers=AUTH)).status == 200
    lower = {"Authorization": f"bearer {KEY}"}  # the scheme is case-insensitive (RFC 9110)
    assert (await client.get("/v1/models", headers=lower)).status == 200
    # What load balancers, Prometheus and the routers' discovery poll from the ops network.
    for path in ("/health", "/metrics", "/v1/state"):
        assert (await client.get(path)).status == 200, path


async def test_tenant_is_believed_only_from_the_key_holder(
    aiohttp_client: Any, checkpoint: Path, llm: LLMEngine
) -> None:
    client = await keyed(aiohttp_client, checkpoint, llm)
    sent = {**AUTH, "x-edge-tenant": "acme"}
    assert (await client.post("/v1/completions", json=COMPLETION, headers=sent)).status == 200
    bad = {"prompt": "hi", "max_tokens": -1}
    assert (await client.post("/v1/completions", json=bad, headers=sent)).status == 400
    sample = 'edgeinfer_requests_total{outcome="%s",tenant="acme"}'
    assert await metric(client, sample % "success") == 1
    assert await metric(client, sample % "invalid") == 1


async def test_without_a_key_tenants_label_no_metric(
    aiohttp_client: Any, checkpoint: Path, llm: LLMEngine
) -> None:
    # Anyone may claim any tenant here: a label per claim would grow without bound.
    client = await start(aiohttp_client, daemon_config(checkpoint), llm)
    for i in range(3):
        headers = {"x-edge-tenant": f"tenant-{i}"}
        assert (
            await client.post("/v1/completions", json=COMPLETION, headers=headers)
        ).status == 200
    assert await metric(client, 'edgeinfer_requests_total{outcome="success",tenant=""}') == 3


async def test_request_id_is_kept_or_made_and_returned_on_every_answer(
    aiohttp_client: Any, checkpoint: Path, llm: LLMEngine
) -> None:
    client = await keyed(aiohttp_client, checkpoint, llm)
    given = {**AUTH, "X-Request-Id": "client-id.42:a_b-c"}
    resp = await client.post("/v1/completions", json=COMPLETION, headers=given)
    assert resp.headers["X-Request-Id"] == "client-id.42:a_b-c"
    stream = await client.post(
        "/v1/completions", json={**COMPLETION, "stream": True}, headers=given
    )
    assert stream.headers["X-Request-Id"] == "client-id.42:a_b-c"
    assert (await read_events(stream))[-1] == "[DONE]"
    for headers, path in [
        ({"X-Request-Id": "has space"}, "/v1/models"),  # refused (401), still stamped
        ({**AUTH, "X-Request-Id": "x" * 129}, "/v1/nothing"),  # a 404
        ({**AUTH, "X-Request-Id": 'quote"d'}, "/v1/models"),
        ({}, "/health"),
    ]:
        resp = await client.get(path, headers=headers)
        assert re.fullmatch(r"[0-9a-f]{32}", resp.headers["X-Request-Id"]), (path, resp.status)


async def test_log_lines_about_a_request_carry_its_id(
    aiohttp_client: Any, checkpoint: Path, llm: LLMEngine, caplog: pytest.LogCaptureFixture
) -> None:
    client = await keyed(aiohttp_client, checkpoint, llm)
    caplog.handler.addFilter(RequestIdFilter())  # what configure_logging installs
    caplog.set_level(logging.DEBUG, logger="edgeinfer.daemon.api.handlers")
    headers = {**AUTH, "X-Request-Id": "trace-me-1", "x-edge-tenant": "acme"}
    assert (await client.post("/v1/completions", json=COMPLETION, headers=headers)).status == 200
    about = [r for r in caplog.records if r.name == "edgeinfer.daemon.api.handlers"]
    assert about and all(getattr(r, "request_id", None) == "trace-me-1" for r in about)
    assert "acme" in about[0].getMessage()
