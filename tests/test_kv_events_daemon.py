"""The daemon's side of the prefix index: the block manager's change feed, the event log's
numbering and ``GET /v1/kv_snapshot`` / ``/v1/state`` of an app around a real engine."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from daemon_helpers import build_checkpoint, daemon_config, load_engine, start
from edgeinfer.daemon.api.cache_salt import effective_cache_salt
from edgeinfer.daemon.engine.block_manager import BlockManager, block_hash, salt_key
from edgeinfer.daemon.engine.llm_engine import LLMEngine
from edgeinfer.daemon.engine.sampler import SamplingState
from edgeinfer.daemon.engine.sampling_params import SamplingParams
from edgeinfer.daemon.engine.sequence import Sequence
from edgeinfer.daemon.kv_events import KvEventLog, kv_bytes_per_token
from edgeinfer.shared.heartbeat import KvSnapshot

KEY = "the-routers-daemon-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def seq(tokens: list[int], salt: str | None = None) -> Sequence:
    return Sequence("s", tokens, SamplingParams(), SamplingState(SamplingParams()), cache_salt=salt)


def chain(tokens: list[int], salt: str | None, block: int) -> list[bytes]:
    parent, keys = salt_key(salt), []
    for i in range(len(tokens) // block):
        parent = block_hash(parent, tokens[i * block : (i + 1) * block])
        keys.append(parent)
    return keys


def fill(bm: BlockManager, s: Sequence) -> None:
    bm.allocate(s, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.cache_full_blocks(s)


def test_block_manager_reports_final_states_of_changed_keys() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3, 4], salt="t")
    fill(bm, a)
    assert bm.take_changes() == {}  # nothing recorded before track_changes()
    bm.track_changes()
    b = seq([5, 6, 7, 8])
    fill(bm, b)
    assert bm.take_changes() == dict.fromkeys(chain([5, 6, 7, 8], None, 2), True)
    bm.free(a)
    bm.free(b)
    c = seq([9, 9, 9, 9, 9, 9])  # 3 blocks: evicts the least recently freed (a's tail first)
    fill(bm, c)
    changes = bm.take_changes()
    a_keys = chain([1, 2, 3, 4], "t", 2)
    assert changes[a_keys[1]] is False and changes[a_keys[0]] is False
    assert sum(changes.values()) == 3
    # b's head outlives its tail: holdings stay prefix-closed (the router's lookup relies on it).
    assert set(bm.cached_keys()) == {*chain([9] * 6, None, 2), chain([5, 6, 7, 8], None, 2)[0]}
    bm.free(c)
    bm.reset_prefix_cache()
    assert set(bm.take_changes()) == {*chain([9] * 6, None, 2), chain([5, 6, 7, 8], None, 2)[0]}
    assert bm.cached_keys() == []


def test_event_log_numbers_merges_and_snapshots_consistently() -> None:
    woken: list[int] = []
    log = KvEventLog("http://d:1", 5.0)
    log.on_push = lambda: woken.append(1)
    k1, k2 = b"a" * 16, b"b" * 16
    log.push({k1: True})
    log.push({k2: True, k1: False})
    ev = log.take()
    assert ev is not None and (ev.first_seq, ev.seq) == (1, 2) and len(woken) == 2
    assert (ev.stored, ev.removed) == (k2, k1)
    assert log.take() is None


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("kv_events_daemon"))


@pytest.fixture(scope="module")
def llm(checkpoint: Path) -> LLMEngine:
    return load_engine(checkpoint)


@pytest.mark.asyncio
async def test_snapshot_and_state_of_a_serving_daemon(
    aiohttp_client: Any, checkpoint: Path, llm: LLMEngine
) -> None:
    client = await start(aiohttp_client, daemon_config(checkpoint, api_key=KEY), llm)
    assert (await client.get("/v1/kv_snapshot")).status == 401
    resp = await client.get("/v1/kv_snapshot", headers=AUTH)
    assert resp.status == 200
    empty = KvSnapshot.decode(await resp.read())
    tokens = [random.Random(3).randrange(3, 500) for _ in range(70)]
    body = {"prompt": tokens, "max_tokens": 1, "cache_salt": "s"}
    headers = AUTH | {"x-edge-cache-salt": "tenant"}
    assert (await client.post("/v1/completions", json=body, headers=headers)).status == 200
    snap = KvSnapshot.decode(await (await client.get("/v1/kv_snapshot", headers=AUTH)).read())
    held = {snap.keys[i : i + 16] for i in range(0, len(snap.keys), 16)}
    want = chain(tokens, effective_cache_salt("tenant", "s"), snap.block_size)
    assert len(want) == 70 // snap.block_size and set(want) <= held
    assert snap.seq > empty.seq and snap.started_at == empty.started_at

    state = await (await client.get("/v1/state")).json()
    assert state["kv_bytes_per_token"] == kv_bytes_per_token(llm) > 0
    assert state["local_prefill_threshold"] == 512 and state["prefix_caching"] is True
    assert len(state["tokenizer_id"]) == 32
