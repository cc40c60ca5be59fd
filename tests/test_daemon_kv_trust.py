"""A decode daemon connects only to prefill endpoints it knows (issue 16, section 2).

Its configured ``prefill_peers``, or the one the router names in ``x-edge-prefill`` on a request
carrying the daemon key. Any other endpoint, by header or by ``kv_transfer_params`` in the body,
gets a 400 and no connection: a fake ZeroMQ prefill server counts the connections it accepts
(a socket monitor) and the messages it receives, and a trusted request to a second fake server
shows that the counting works.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from cluster import cluster, http_get, metric, wait_healthy
from daemon_helpers import build_checkpoint, daemon_config, load_engine, start
from edgeinfer.daemon.engine.llm_engine import LLMEngine
from edgeinfer.daemon.engine.tiny_checkpoint import build_tiny_checkpoint

KEY = "the-routers-daemon-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Long enough to be prefilled remotely (the threshold is 0) and to be cut into chunks.
PROMPT = "the little town by the sea had one baker and " * 8


@dataclass
class FakePrefill:
    endpoint: str
    accepted: int = 0  # TCP connections accepted
    messages: int = 0
    connected: asyncio.Event = field(default_factory=asyncio.Event)


@contextlib.asynccontextmanager
async def fake_prefill_server() -> AsyncIterator[FakePrefill]:
    """A ZeroMQ ROUTER that never answers; it only counts what reaches it."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED)
    fake = FakePrefill(f"tcp://127.0.0.1:{port}")

    async def count_accepts() -> None:
        while True:
            await monitor.recv_multipart()
            fake.accepted += 1
            fake.connected.set()

    async def count_messages() -> None:
        while True:
            await sock.recv_multipart()
            fake.messages += 1

    tasks = [asyncio.create_task(count_accepts()), asyncio.create_task(count_messages())]
    try:
        yield fake
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        sock.disable_monitor()
        monitor.close()
        sock.close()
        ctx.term()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("kv_trust"))


@pytest.fixture(scope="module")
def llm(checkpoint: Path) -> LLMEngine:
    return load_engine(checkpoint)


def decode_config(checkpoint: Path, **overrides: Any) -> Any:
    # A fake server never answers: the trusted control request gives up on it quickly and
    # prefills locally (the answer is still right).
    return daemon_config(
        checkpoint, role="decode", local_prefill_threshold=0, kv_timeout_s=0.5, **overrides
    )


async def refused(client: Any, endpoint: str, headers: dict[str, str]) -> list[str]:
    """Name ``endpoint`` by header and by body on both APIs; the params each 400 named."""
    params = []
    for path, body in [
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}),
    ]:
        for extra_headers, extra_body in [
            ({"x-edge-prefill": endpoint}, {}),
            ({}, {"kv_transfer_params": {"prefill_endpoint": endpoint}}),
        ]:
            resp = await client.post(
                path, json={**body, **extra_body}, headers={**headers, **extra_headers}
            )
            assert resp.status == 400, (path, extra_headers, extra_body)
            error = (await resp.json())["error"]
            assert error["code"] == "untrusted_prefill_endpoint"
            params.append(error["param"])
    return params


@pytest.mark.asyncio
async def test_without_the_key_only_configured_peers_are_reached(
    aiohttp_client: Any, checkpoint: Path, llm: LLMEngine
) -> None:
    async with fake_prefill_server() as evil, fake_prefill_server() as peer:
        config = decode_config(checkpoint, prefill_peers=(peer.endpoint,))
        client = await start(aiohttp_client, config, llm)
        params = await refused(client, evil.endpoint, {})
        assert params == ["x-edge-prefill", "kv_transfer_params.prefill_endpoint"] * 2
        # The control: a configured peer named by header is reached, and the counting sees it.
        body = {"prompt": PROMPT, "max_tokens": 2}
        ok = await client.post(
            "/v1/completions", json=body, headers={"x-edge-prefill": peer.endpoint}
        )
        assert ok.status == 200
        await asyncio.wait_for(peer.connected.wait(), 30)
        assert peer.messages >= 1
        assert (evil.accepted, evil.messages) == (0, 0)


@pytest.mark.asyncio
async def test_only_the_key_holder_names_other_endpoints(
    aiohttp_client: Any, checkpoint: Path, llm: LLMEngine
) -> None:
    async with fake_prefill_server() as evil, fake_prefill_server() as chosen:
        client = await start(aiohttp_client, decode_config(checkpoint, api_key=KEY), llm)
        body = {"prompt": PROMPT, "max_tokens": 2}
        # Without the key nothing gets in, whatever it names.
        resp = await client.post(
            "/v1/completions", json=body, headers={"x-edge-prefill": evil.endpoint}
        )
        assert resp.status == 401
        # With it, the body still names nothing (only the router's header counts).
        resp = await client.post(
            "/v1/completions",
            json={**body, "kv_transfer_params": {"prefill_endpoint": evil.endpoint}},
            headers={**AUTH, "x-edge-prefill": chosen.endpoint},
        )
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == "kv_transfer_params.prefill_endpoint"
        assert (chosen.accepted, chosen.messages) == (0, 0)
        # The control: the router's choice, with the key, is reached.
        headers = {**AUTH, "x-edge-prefill": chosen.endpoint}
        assert (await client.post("/v1/completions", json=body, headers=headers)).status == 200
        await asyncio.wait_for(chosen.connected.wait(), 30)
        assert (evil.accepted, evil.messages) == (0, 0)


def post(
    url: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[int, dict[str, Any], Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **headers}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read()), resp.headers
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), exc.headers


def test_router_keyed_request_prefills_at_the_daemon_it_names(tmp_path: Path) -> None:
    """Real processes: a decode daemon with an api_key and no configured peer fetches KV from
    the prefill daemon a key-bearing request names, and logs that request's id and tenant."""
    model = build_tiny_checkpoint(tmp_path / "m")
    with cluster(tmp_path) as c:
        prefill = c.daemon("prefill", model, "--role", "prefill", env={"EDGEINFER_API_KEY": KEY})
        decode = c.daemon(
            "decode", model, "--role", "decode", "--local-prefill-threshold", "0",
            "--api-key", KEY,
        )  # fmt: skip
        wait_healthy(prefill)
        wait_healthy(decode)
        url = decode.url + "/v1/completions"
        body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        status, local, _ = post(url, body, AUTH)  # no peer named: prefilled here
        assert status == 200
        routed = {**AUTH, "x-edge-prefill": prefill.tcp_endpoint("kv"),
                  "x-edge-tenant": "acme", "X-Request-Id": "kv-trust-1"}  # fmt: skip
        status, remote, headers = post(url, body, routed)
        assert status == 200 and headers["X-Request-Id"] == "kv-trust-1"
        assert remote["choices"][0]["text"] == local["choices"][0]["text"]
        assert metric(decode.url, "edgeinfer_kv_transfer_bytes_total", 'direction="received"') > 0
        assert metric(prefill.url, "edgeinfer_kv_transfer_seconds_count") == 1
        sample = 'outcome="success",tenant="acme"'
        assert metric(decode.url, "edgeinfer_requests_total", sample) == 1
        # The same request without the key: refused, and the prefill daemon saw nothing more.
        status, error, _ = post(url, body, {"x-edge-prefill": prefill.tcp_endpoint("kv")})
        assert status == 401 and error["error"]["code"] == "invalid_api_key"
        assert metric(prefill.url, "edgeinfer_kv_transfer_seconds_count") == 1
        assert http_get(decode.url + "/v1/state")[0] == 200  # discovery needs no key
        access = [line for line in decode.output(20000).splitlines() if "kv-trust-1" in line]
        assert any('"POST /v1/completions HTTP/1.1" 200' in line and "tenant=acme" in line
                   for line in access), access  # fmt: skip
