"""The daemon's cache salt over HTTP: ``x-edge-cache-salt`` and the body's ``cache_salt`` keep
tenants' prefix caches apart, as ``usage.prompt_tokens_details.cached_tokens`` shows."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from daemon_helpers import (
    daemon_config,
    load_engine,
    read_events,
    start,
    wait_for_idle_engine,
)
from edgeinfer.daemon.api.cache_salt import CACHE_SALT_HEADER

pytestmark = pytest.mark.asyncio

PROMPT_LEN = 40  # two whole 16-token blocks can be reused (the last token is always computed)


@pytest_asyncio.fixture
async def client(aiohttp_client: Any, checkpoint: Path) -> Any:
    client = await start(aiohttp_client, daemon_config(checkpoint), load_engine(checkpoint))
    yield client
    stats = await wait_for_idle_engine(client)
    assert stats.num_running == 0 and stats.kv_blocks_used == 0


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(PROMPT_LEN)]


async def complete(
    client: Any, ids: list[int], salt: str | None = None, **body: Any
) -> dict[str, Any]:
    headers = {} if salt is None else {CACHE_SALT_HEADER: salt}
    req = {"prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True, **body}
    resp = await client.post("/v1/completions", json=req, headers=headers)
    assert resp.status == 200, await resp.text()
    return await resp.json()


def cached(data: dict[str, Any]) -> int:
    return data["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_tenants_header_salts_apart(client: Any) -> None:
    ids = prompt(1)
    first = await complete(client, ids, "tenant-a")
    assert cached(first) == 0
    assert cached(await complete(client, ids, "tenant-a")) == 32
    other = await complete(client, ids, "tenant-b")
    assert cached(other) == 0  # B neither reuses nor detects A's prompt
    assert cached(await complete(client, ids, "tenant-b")) == 32  # within B it works
    assert cached(await complete(client, ids)) == 0  # nor does an unsalted request
    assert other["choices"][0]["text"] == first["choices"][0]["text"]


async def test_body_cache_salt_splits_within_a_tenant(client: Any) -> None:
    ids = prompt(2)
    assert cached(await complete(client, ids, "tenant-a", cache_salt="session-1")) == 0
    assert cached(await complete(client, ids, "tenant-a", cache_salt="session-1")) == 32
    assert cached(await complete(client, ids, "tenant-a", cache_salt="session-2")) == 0
    assert cached(await complete(client, ids, "tenant-a")) == 0
    assert cached(await complete(client, ids, cache_salt="session-1")) == 0
    assert cached(await complete(client, ids, "tenant-b", cache_salt="session-1")) == 0


async def test_chat_streaming_usage_reports_cached_tokens(client: Any) -> None:
    messages = [{"role": "user", "content": "tell me about salted caches " * 4}]
    body = {"messages": messages, "max_tokens": 3, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "cache_salt": "chat-1"}  # fmt: skip
    seen = []
    for salt in ("tenant-a", "tenant-a", "tenant-b"):
        resp = await client.post(
            "/v1/chat/completions", json=body, headers={CACHE_SALT_HEADER: salt}
        )
        assert resp.status == 200
        events = await read_events(resp)
        usage = events[-2]
        assert isinstance(usage, dict) and usage["choices"] == []
        seen.append(cached(usage))
    assert seen[0] == 0 and seen[1] > 0 and seen[2] == 0
    # Tenant b's repeat, as one JSON body this time: its own cache serves it.
    plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    resp = await client.post(
        "/v1/chat/completions", json=plain, headers={CACHE_SALT_HEADER: "tenant-b"}
    )
    assert cached(await resp.json()) == seen[1]


@pytest.mark.parametrize("salt", [123, "", "x" * 257, ["a"], {"a": 1}, True])
async def test_bad_cache_salt_is_a_400_naming_it(client: Any, salt: Any) -> None:
    body = {"prompt": "hello", "max_tokens": 2, "cache_salt": salt}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["param"] == "cache_salt" and "cache_salt" in error["message"]
