"""Heartbeat schema, the daemon's publisher and rate meter, and the router's listener over zmq."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from typing import Any

import msgpack
import msgspec
import pytest
import zmq
import zmq.asyncio
from hypothesis import given, settings
from hypothesis import strategies as st

from edgeinfer.daemon.heartbeat import HeartbeatPublisher, RateMeter, RecentMedian
from edgeinfer.daemon.kv_events import KvEventLog
from edgeinfer.router.heartbeat_listener import HeartbeatListener
from edgeinfer.router.pop_registry import PopConfig, PopRegistry
from edgeinfer.shared.heartbeat import (
    HEARTBEAT_VERSION,
    Heartbeat,
    HeartbeatError,
    HeartbeatVersionError,
)

URL = "http://fra-1:8000"


def fields(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "v": HEARTBEAT_VERSION,
        "daemon_id": URL,
        "pop": "fra",
        "role": "both",
        "model": "m",
        "kv_endpoint": "tcp://fra-1:5600",
        "running": 3,
        "waiting": 1,
        "kv_blocks_free": 10,
        "kv_blocks_total": 100,
        "block_size": 16,
        "prefill_tokens_per_s": 9000.0,
        "decode_tokens_per_s": 400.0,
        "ttft_p50_s": 0.2,
        "itl_p50_s": None,
        "queued_prefill_tokens": 700,
        "draining": False,
        "drained": False,
        "in_flight": 4,
        "kv_bytes_per_token": 23_040,
        "local_prefill_threshold": 512,
        "prefill_chunk_tokens": 2048,
        "tokenizer_id": "0f1e",
        "prefix_caching": True,
        "kv_event_seq": 0,
        "seq": 7,
        "started_at": 1.7e9,
        "sent_at": 1.7e9 + 35,
    }
    return base | overrides


def wire(**overrides: Any) -> bytes:
    """A heartbeat as another producer might encode it: a plain msgpack map with its tag."""
    return msgpack.packb({"type": "heartbeat"} | fields(**overrides))


def test_roundtrip_and_int_rates_become_floats() -> None:
    hb = Heartbeat(**fields())
    assert Heartbeat.decode(hb.encode()) == hb
    decoded = Heartbeat.decode(wire(prefill_tokens_per_s=9000))
    assert isinstance(decoded.prefill_tokens_per_s, float) and decoded.prefill_tokens_per_s == 9000


def test_unknown_keys_are_ignored_for_forward_compatibility() -> None:
    assert Heartbeat.decode(wire(gpu_temp_c=71)).daemon_id == URL


def test_a_version_1_heartbeat_is_refused_as_such() -> None:
    v1 = {k: v for k, v in fields(v=1).items() if k not in ("kv_bytes_per_token", "tokenizer_id")}
    with pytest.raises(HeartbeatVersionError, match="version 1"):
        Heartbeat.decode(msgpack.packb(v1))


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"v": 1}, "version"),
        ({"v": 3}, "version"),
        ({"v": True}, "version"),
        ({"kv_bytes_per_token": 0}, "kv_bytes_per_token"),
        ({"tokenizer_id": ""}, "tokenizer_id"),
        ({"kv_event_seq": -1}, "kv_event_seq"),
        ({"running": True}, "running"),
        ({"waiting": -1}, "waiting"),
        ({"kv_blocks_free": 101}, "exceeds"),
        ({"block_size": 0}, "block_size"),
        ({"decode_tokens_per_s": math.nan}, "decode_tokens_per_s"),
        ({"ttft_p50_s": -0.1}, "ttft_p50_s"),
        ({"role": "router"}, "role"),
        ({"daemon_id": "fra-1:8000"}, "daemon_id"),
        ({"pop": ""}, "pop"),
        ({"kv_endpoint": 5}, "kv_endpoint"),
        ({"draining": 1}, "draining"),
    ],
)
def test_invalid_fields_are_rejected(overrides: dict[str, Any], match: str) -> None:
    with pytest.raises(HeartbeatError, match=match):
        Heartbeat.decode(wire(**overrides))


def test_construction_checks_what_spans_fields() -> None:
    with pytest.raises(ValueError, match="exceeds"):
        Heartbeat(**fields(kv_blocks_free=101))


def test_structural_garbage_is_rejected() -> None:
    data = {"type": "heartbeat"} | fields()
    del data["seq"]
    for bad in (msgpack.packb(data), msgpack.packb([1, 2]), b"\xc1", b"x" * 70_000, b""):
        with pytest.raises(HeartbeatError):
            Heartbeat.decode(bad)


@given(st.binary(max_size=512))
def test_random_bytes_raise_only_heartbeat_error(data: bytes) -> None:
    with contextlib.suppress(HeartbeatError):
        Heartbeat.decode(data)


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=300, deadline=None)  # a GC pause is not a failure
@given(st.dictionaries(st.sampled_from(sorted(fields())) | st.text(), _values, max_size=6))
def test_mutated_heartbeats_raise_only_heartbeat_error(changes: dict[str, Any]) -> None:
    with contextlib.suppress(HeartbeatError):
        Heartbeat.decode(msgpack.packb({"type": "heartbeat"} | fields() | changes))


def test_rate_meter_measures_busy_time_and_keeps_the_last_rate_when_idle() -> None:
    meter = RateMeter(window_s=10.0, clock=lambda: 0.0)
    assert meter.rate(now=0.0) == 0.0
    meter.add(1000, busy_s=0.5, now=1.0)
    meter.add(1000, busy_s=0.5, now=2.0)
    assert meter.rate(now=3.0) == pytest.approx(2000.0)
    assert meter.rate(now=100.0) == pytest.approx(2000.0)  # idle, not slower
    meter.add(100, busy_s=1.0, now=101.0)
    assert meter.rate(now=101.0) == pytest.approx(100.0)
    with pytest.raises(ValueError):
        meter.add(-1, busy_s=1.0)


def test_latency_medians_forget_an_idle_daemons_last_busy_spell() -> None:
    # Latency depends on load: a daemon over the ITL SLO under a burst and idle since must
    # not report that ITL for ever (the router would never send it a request to measure again).
    recent = RecentMedian(window_s=30.0, maxlen=4, clock=lambda: 0.0)
    assert recent.median(now=0.0) is None
    for t, itl in ((1.0, 0.5), (2.0, 0.7), (3.0, 0.6)):
        recent.add(itl, now=t)
    assert recent.median(now=10.0) == pytest.approx(0.6)
    assert recent.median(now=31.5) == pytest.approx(0.65)  # the first aged out
    assert recent.median(now=100.0) is None  # idle: nothing recent, nothing reported
    for t in range(6):  # and at most maxlen samples are kept
        recent.add(float(t), now=200.0 + t)
    assert recent.median(now=206.0) == pytest.approx(3.5)
    with pytest.raises(ValueError):
        RecentMedian(window_s=0.0)


def test_listener_counts_malformed_and_verdicts() -> None:
    registry = PopRegistry([PopConfig("fra", 50.1, 8.7, (URL,))], "fra", 1.0)
    listener = HeartbeatListener(registry, 1.0, clock=lambda: 5.0)
    good = Heartbeat(**fields()).encode()
    listener.handle([b"junk"])
    listener.handle([good, good])
    listener.handle([good])
    listener.handle([good])  # same seq again
    listener.handle([Heartbeat(**fields(daemon_id="http://x:1")).encode()])
    assert listener.counts == {
        "received": 5,
        "malformed": 2,
        "accepted": 1,
        "out_of_order": 1,
        "unknown_daemon": 1,
    }


async def _wait_for(predicate: Any, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


@pytest.mark.asyncio
async def test_publisher_to_listener_over_loopback_updates_the_registry() -> None:
    ctx = zmq.asyncio.Context()
    registry = PopRegistry([PopConfig("fra", 50.1, 8.7, (URL,))], "fra", 0.05)
    stream = ("v", "seq", "started_at", "sent_at", "kv_event_seq")
    state = {k: v for k, v in fields().items() if k not in stream}
    calls = 0

    def current() -> dict[str, Any]:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("a failing state callback costs one heartbeat")
        return state

    publisher = HeartbeatPublisher("tcp://127.0.0.1:*", 0.02, current, context=ctx)
    listener = HeartbeatListener(registry, 0.05, context=ctx)
    try:
        await publisher.start()
        assert publisher.endpoint is not None
        listener.subscribe(publisher.endpoint)  # before start: connected by start()
        await listener.start()
        await _wait_for(lambda: listener.counts["accepted"] >= 3)
        view = registry.snapshot(time.monotonic())[0]
        assert view.available and view.role == "both" and view.queued_prefill_tokens == 700
        (daemon,) = registry.daemons()
        assert daemon.heartbeat is not None and daemon.heartbeat.seq >= 2
        assert listener.counts["malformed"] == 0
        # A drain is announced at once, without waiting for the next period.
        state["draining"] = True
        sent = await publisher.publish_now()
        assert sent.draining
        await _wait_for(lambda: not registry.snapshot(time.monotonic())[0].available)
        listener.unsubscribe(publisher.endpoint)
        assert listener.endpoints == frozenset()
    finally:
        await listener.stop()
        await publisher.stop()
        ctx.term()


def test_publisher_replaces_stream_fields_of_a_whole_heartbeat() -> None:
    async def main() -> Heartbeat:
        ctx = zmq.asyncio.Context()
        given_hb = Heartbeat(**fields(seq=99, started_at=1.0))
        pub = HeartbeatPublisher(
            "inproc://hb-test", 1.0, lambda: given_hb, context=ctx, started_at=5.0
        )
        await pub.start()
        try:
            await pub.publish_now()
            return await pub.publish_now()
        finally:
            await pub.stop()
            ctx.term()

    sent = asyncio.run(main())
    assert (sent.seq, sent.started_at) == (1, 5.0)
    replace = msgspec.structs.replace
    assert replace(sent, seq=99, started_at=1.0, sent_at=0.0) == replace(
        Heartbeat(**fields(seq=99, started_at=1.0)), sent_at=0.0
    )


@pytest.mark.asyncio
async def test_cache_events_travel_before_the_heartbeat_that_counts_them() -> None:
    ctx = zmq.asyncio.Context()
    registry = PopRegistry([PopConfig("fra", 50.1, 8.7, (URL,))], "fra", 0.05)
    stream = ("v", "seq", "started_at", "sent_at", "kv_event_seq")
    state = {k: v for k, v in fields().items() if k not in stream}
    events = KvEventLog(URL, 7.0)
    publisher = HeartbeatPublisher(
        "tcp://127.0.0.1:*", 0.02, lambda: state, context=ctx, started_at=7.0, events=events
    )
    listener = HeartbeatListener(registry, 0.05, context=ctx)
    key = bytes(range(16))
    try:
        await publisher.start()
        assert publisher.endpoint is not None
        listener.subscribe(publisher.endpoint)
        await listener.start()
        await _wait_for(lambda: registry.kv.synced(URL))  # kv_event_seq 0: synced, empty
        # Pushed from another thread, as the engine does after a step.
        await asyncio.to_thread(events.push, {key: True})
        await _wait_for(lambda: registry.prefix_index.lookup([key]) == {URL: 1})
        await _wait_for(lambda: registry.daemons()[0].heartbeat.kv_event_seq == 1)  # type: ignore[union-attr]
        assert registry.kv.counts["gaps"] == 0 and registry.kv.counts["resyncs"] == 0
    finally:
        await listener.stop()
        await publisher.stop()
        ctx.term()
