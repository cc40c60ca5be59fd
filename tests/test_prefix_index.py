"""The router's prefix index, the sequencing of cache events into it, and their messages."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from typing import Any

import aiohttp
import msgpack
import numpy as np
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from edgeinfer.router.heartbeat_listener import HeartbeatListener
from edgeinfer.router.kv_sync import MAX_BUFFERED, KvSync, SnapshotFetcher
from edgeinfer.router.pop_registry import PopConfig, PopRegistry
from edgeinfer.router.prefix_index import PrefixIndex, key_array, sorted_keys
from edgeinfer.shared.heartbeat import (
    Heartbeat,
    HeartbeatError,
    KvEvents,
    KvSnapshot,
    decode_message,
)

A, B = "http://a:8000", "http://b:8000"


def keys(*names: int) -> list[bytes]:
    return [hashlib.blake2b(str(n).encode(), digest_size=16).digest() for n in names]


def events(first: int, seq: int | None = None, stored=(), removed=(), url=A, started=1.0):
    return KvEvents(
        daemon_id=url, started_at=started, first_seq=first, seq=seq or first,
        stored=b"".join(keys(*stored)), removed=b"".join(keys(*removed)),
    )  # fmt: skip


def heartbeat(url: str = A, seq: int = 0, kv_seq: int = 0, started: float = 1.0, **kw: Any):
    fields: dict[str, Any] = {
        "daemon_id": url, "pop": "p", "role": "both", "model": "m", "kv_endpoint": None,
        "running": 0, "waiting": 0, "kv_blocks_free": 10, "kv_blocks_total": 10,
        "block_size": 16, "prefill_tokens_per_s": 0.0, "decode_tokens_per_s": 0.0,
        "ttft_p50_s": None, "itl_p50_s": None, "queued_prefill_tokens": 0, "draining": False,
        "drained": False, "in_flight": 0, "kv_bytes_per_token": 4096,
        "local_prefill_threshold": 64, "prefill_chunk_tokens": 256, "tokenizer_id": "t",
        "prefix_caching": True, "kv_event_seq": kv_seq, "seq": seq, "started_at": started,
        "sent_at": started + seq,
    }  # fmt: skip
    return Heartbeat(**(fields | kw))


# ---- the index --------------------------------------------------------------------------
def test_lookup_counts_leading_blocks_per_daemon() -> None:
    index = PrefixIndex()
    index.replace(A, sorted_keys(keys(1, 2, 3, 9)))
    index.replace(B, sorted_keys(keys(1, 5)))
    assert index.lookup(keys(1, 2, 3, 4)) == {A: 3, B: 1}
    assert index.lookup(keys(2, 3)) == {A: 2}  # a chain that starts elsewhere is no hit
    assert index.lookup(keys(7)) == {}
    assert index.lookup(keys(1, 2), daemons=[B, "http://unknown:1"]) == {B: 1}
    assert index.lookup([]) == {}
    assert len(index) == 6


def test_events_update_and_merge_into_the_sorted_array() -> None:
    index = PrefixIndex()
    index.apply(A, key_array(keys(*range(3000))), key_array([]))  # past the merge threshold
    index.apply(A, key_array(keys(3000)), key_array(keys(1)))
    assert index.lookup(keys(0, 1)) == {A: 1}
    assert index.lookup(keys(3000)) == {A: 1}
    index.apply(A, key_array(keys(1)), key_array(keys(0)))
    assert index.lookup(keys(1, 2)) == {A: 2} and index.lookup(keys(0)) == {}
    assert index.held_by(A) == 3000
    index.forget(A)
    assert index.lookup(keys(1)) == {} and len(index) == 0


def test_the_filter_passes_every_key_held_and_few_others() -> None:
    index = PrefixIndex()
    index.replace(A, sorted_keys(keys(*range(5000))))
    h = index._daemons[A]
    assert all(index.lookup(keys(n)) == {A: 1} for n in range(0, 5000, 7))
    others = key_array(keys(*range(5000, 15000))).tolist()
    passed = sum(h.bloom[(k & h.mask) >> 3] >> (k & 7) & 1 for k in others)
    assert 0 < passed < 0.13 * len(others)  # false positives exist and are searched
    assert all(index.lookup(keys(n)) == {} for n in range(5000, 15000, 7))
    assert index.nbytes() >= 8 * 5000 + 5000  # the array and at least a byte a key of filter
    # Keys stored since the array was built pass the filter too (a miss is a key not held)...
    index.apply(A, key_array(keys(*range(5000, 5100))), key_array([]))
    assert len(h.added) == 100 and h.bloom is index._daemons[A].bloom
    added = key_array(keys(*range(5000, 5100))).tolist()
    assert all(h.bloom[(k & h.mask) >> 3] >> (k & 7) & 1 for k in added)
    assert all(index.lookup(keys(n)) == {A: 1} for n in range(5000, 5100))
    # ...and a daemon known from events alone (no array, no filter yet) is found by its set.
    index.apply(B, key_array(keys(7)), key_array([]))
    assert index.lookup(keys(7, 8)) == {A: 2, B: 1}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 40)), max_size=400))
def test_index_agrees_with_a_set_model(ops: list[tuple[bool, int]]) -> None:
    index, model = PrefixIndex(), set()
    index.replace(A, sorted_keys(keys(*range(0, 40, 3))))
    model.update(range(0, 40, 3))
    for store, n in ops:
        stored, removed = (keys(n), []) if store else ([], keys(n))
        index.apply(A, key_array(stored), key_array(removed))
        (model.add if store else model.discard)(n)
        if len(model) % 7 == 0:
            index._daemons[A].merge()
    assert index.held_by(A) == len(model)
    for n in range(41):
        assert index.lookup(keys(n)) == ({A: 1} if n in model else {})


def test_key_array_refuses_partial_keys() -> None:
    with pytest.raises(ValueError):
        key_array(b"x" * 17)


# ---- messages -----------------------------------------------------------------------------
def test_kv_messages_roundtrip_and_refuse_unknown_fields() -> None:
    ev = events(1, 2, stored=(1, 2), removed=(3,))
    assert decode_message(ev.encode()) == ev
    snap = KvSnapshot(daemon_id=A, started_at=1.0, seq=5, block_size=16, keys=b"".join(keys(1)))
    assert KvSnapshot.decode(snap.encode()) == snap
    extra = msgpack.unpackb(ev.encode()) | {"surprise": 1}
    with pytest.raises(HeartbeatError, match="unknown field"):
        decode_message(msgpack.packb(extra))
    for bad in ({"stored": b"x" * 15}, {"first_seq": 3, "seq": 2}, {"seq": 0}):
        with pytest.raises(HeartbeatError):
            decode_message(msgpack.packb(msgpack.unpackb(ev.encode()) | bad))
    with pytest.raises(HeartbeatError):
        KvSnapshot.decode(msgpack.packb(msgpack.unpackb(snap.encode()) | {"keys": b"x"}))


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["type", "daemon_id", "seq", "first_seq", "stored",
                                        "started_at", "removed"]) | st.text(),
                       st.none() | st.integers(-5, 2**64 - 1) | st.binary(max_size=40)
                       | st.text(max_size=5) | st.floats(), max_size=7))  # fmt: skip
def test_garbage_raises_only_heartbeat_error(changes: dict[str, Any]) -> None:
    with contextlib.suppress(HeartbeatError):
        decode_message(msgpack.packb(msgpack.unpackb(events(1).encode()) | changes))


def test_listener_counts_kv_events_and_garbage_without_crashing() -> None:
    registry = PopRegistry([PopConfig("p", 1.0, 1.0, (A,))], "p", 1.0)
    listener = HeartbeatListener(registry, 1.0, clock=lambda: 5.0)
    listener.handle([events(1, stored=(1,)).encode()])  # before any heartbeat: not placed
    listener.handle([heartbeat(kv_seq=0).encode()])
    listener.handle([events(1, stored=(1,)).encode()])
    listener.handle([events(2, stored=(2,)).encode()])
    listener.handle([b"\x81\xa4type\xa9kv_events"])
    listener.handle([events(3, url="http://stranger:1").encode()])
    assert registry.prefix_index.lookup(keys(1, 2)) == {A: 2}
    assert listener.counts["kv_applied"] == 2 and listener.counts["kv_unplaced"] == 1
    assert listener.counts["malformed"] == 1 and listener.counts["unknown_daemon"] == 1


# ---- sequencing ---------------------------------------------------------------------------
def test_a_gap_asks_for_a_snapshot_and_buffers_until_it_lands() -> None:
    sync = KvSync(PrefixIndex())
    sync.on_heartbeat(A, heartbeat())
    assert sync.synced(A) and not sync.wanted
    assert sync.on_events(A, events(1, stored=(1,))) == "kv_applied"
    assert sync.on_events(A, events(1, stored=(1,))) == "kv_duplicate"
    assert sync.on_events(A, events(3, stored=(3,))) == "kv_gap"  # batch 2 lost
    assert sync.wanted == {A} and not sync.synced(A) and sync.counts["resyncs"] == 1
    assert sync.on_events(A, events(4, stored=(4,), removed=(1,))) == "kv_buffered"
    snap = KvSnapshot(
        daemon_id=A, started_at=1.0, seq=3, block_size=16, keys=b"".join(keys(1, 2, 3))
    )
    assert sync.on_snapshot(A, snap)
    assert sync.synced(A) and sync.index.lookup(keys(2, 3, 4)) == {A: 3}
    assert sync.index.lookup(keys(1)) == {}  # batch 4, applied after the snapshot


def test_a_lost_last_batch_is_seen_in_the_next_heartbeat() -> None:
    sync = KvSync(PrefixIndex())
    sync.on_heartbeat(A, heartbeat())
    sync.on_events(A, events(1, stored=(1,)))
    sync.on_heartbeat(A, heartbeat(seq=1, kv_seq=1))
    assert not sync.wanted
    sync.on_heartbeat(A, heartbeat(seq=2, kv_seq=2))
    assert sync.wanted == {A} and sync.counts["gaps"] == 1


def test_late_subscriber_fetches_and_a_restart_clears() -> None:
    sync = KvSync(PrefixIndex())
    sync.on_heartbeat(A, heartbeat(kv_seq=7))
    assert sync.wanted == {A} and not sync.synced(A)
    snap = KvSnapshot(daemon_id=A, started_at=1.0, seq=7, block_size=16, keys=b"".join(keys(1)))
    assert sync.on_snapshot(A, snap)
    assert sync.index.lookup(keys(1)) == {A: 1}
    # A new process: what the old one held is gone; its batch 1 starts from empty.
    assert sync.on_events(A, events(1, stored=(2,), started=2.0)) == "kv_applied"
    assert sync.index.lookup(keys(1)) == {} and sync.index.lookup(keys(2)) == {A: 1}
    assert sync.counts["restarts"] == 1
    assert sync.on_events(A, events(9, started=1.0)) == "kv_stale"  # the old process, late
    assert not sync.on_snapshot(A, snap)  # nor its snapshot
    sync.on_heartbeat(A, heartbeat(prefix_caching=False, started=2.0))
    assert A not in sync.index


def test_a_buffer_overflow_fetches_again() -> None:
    sync = KvSync(PrefixIndex())
    sync.on_heartbeat(A, heartbeat(kv_seq=1))
    for i in range(MAX_BUFFERED + 1):
        sync.on_events(A, events(2 + i, stored=(i,)))
    sync.wanted.clear()
    snap = KvSnapshot(daemon_id=A, started_at=1.0, seq=1, block_size=16, keys=b"")
    assert sync.on_snapshot(A, snap)
    assert sync.wanted == {A} and not sync.synced(A)


def test_registry_forgets_removed_daemons_and_offers_invariants() -> None:
    registry = PopRegistry([PopConfig("p", 1.0, 1.0, (A,))], "p", 1.0)
    registry.update(heartbeat(), 1.0)
    registry.kv_events(events(1, stored=(1,)))
    view = registry.snapshot(1.0)[0]
    assert (view.kv_bytes_per_token, view.local_prefill_threshold) == (4096, 64)
    assert (view.prefill_chunk_tokens, view.tokenizer_id) == (256, "t")
    assert registry.prefix_index.lookup(keys(1)) == {A: 1}
    registry.replace_pops([PopConfig("p", 1.0, 1.0, ())])
    assert registry.prefix_index.lookup(keys(1)) == {}
    assert np.array_equal(key_array(keys(1)), key_array(b"".join(keys(1))))


@pytest.mark.asyncio
async def test_fetcher_retries_a_failing_daemon_and_installs_its_snapshot(
    aiohttp_server: Any,
) -> None:
    answers = [web.Response(status=401), web.Response(body=b"garbage")]
    snap: KvSnapshot | None = None

    async def handler(request: web.Request) -> web.Response:
        assert request.headers.get("Authorization") is None  # no daemon key configured
        assert snap is not None
        return answers.pop(0) if answers else web.Response(body=snap.encode())

    app = web.Application()
    app.router.add_get("/v1/kv_snapshot", handler)
    server = await aiohttp_server(app)
    url = str(server.make_url("")).rstrip("/")
    snap = KvSnapshot(daemon_id=url, started_at=1.0, seq=4, block_size=16, keys=keys(1)[0])
    sync = KvSync(PrefixIndex())
    sync.on_heartbeat(url, heartbeat(url=url, kv_seq=4))
    async with aiohttp.ClientSession() as session:
        fetcher = SnapshotFetcher(sync, session, retry_s=0.01)
        await fetcher.start()
        try:
            for _ in range(500):
                if sync.synced(url):
                    break
                await asyncio.sleep(0.01)
        finally:
            await fetcher.stop()
    assert sync.synced(url) and sync.index.lookup(keys(1)) == {url: 1}
    assert sync.counts["snapshot_errors"] == 2 and sync.counts["snapshots"] == 1
