"""PopRegistry: freshness, draining, restarts and ordering, reloads, RTT, snapshots."""

from __future__ import annotations

from typing import Any

import pytest

from edgeinfer.router.errors import RouterError
from edgeinfer.router.pop_registry import PopConfig, PopRegistry
from edgeinfer.shared.heartbeat import Heartbeat

FRA, NYC = "http://fra-1:8000", "http://nyc-1:8000"
PERIOD = 1.0


def hb(url: str = FRA, pop: str = "fra", seq: int = 1, **overrides: Any) -> Heartbeat:
    fields: dict[str, Any] = {
        "daemon_id": url,
        "pop": pop,
        "role": "both",
        "model": "m",
        "kv_endpoint": url.replace("http", "tcp").replace("8000", "5600"),
        "running": 2,
        "waiting": 0,
        "kv_blocks_free": 50,
        "kv_blocks_total": 100,
        "block_size": 16,
        "prefill_tokens_per_s": 8000.0,
        "decode_tokens_per_s": 300.0,
        "ttft_p50_s": None,
        "itl_p50_s": None,
        "queued_prefill_tokens": 0,
        "draining": False,
        "drained": False,
        "in_flight": 2,
        "kv_bytes_per_token": 23_040,
        "local_prefill_threshold": 512,
        "prefill_chunk_tokens": 2048,
        "tokenizer_id": "t1",
        "prefix_caching": False,
        "kv_event_seq": 0,
        "seq": seq,
        "started_at": 100.0,
        "sent_at": 100.0 + seq,
    }
    return Heartbeat(**(fields | overrides))


def pops() -> list[PopConfig]:
    return [PopConfig("fra", 50.11, 8.68, (FRA,)), PopConfig("nyc", 40.71, -74.01, (NYC + "/",))]


@pytest.fixture
def reg() -> PopRegistry:
    # No coalescing: every heartbeat is in the next snapshot (coalescing has its own test).
    return PopRegistry(pops(), here="fra", heartbeat_interval_s=PERIOD, coalesce_s=0.0)


def state(reg: PopRegistry, url: str, now: float) -> str:
    return next(v for v in reg.snapshot(now) if v.url == url).state


def test_pop_table_is_validated() -> None:
    with pytest.raises(RouterError, match="lat"):
        PopConfig("x", 91.0, 0.0)
    with pytest.raises(RouterError, match="twice"):
        PopConfig("x", 0.0, 0.0, ("http://a:1", "http://a:1/"))
    with pytest.raises(RouterError, match="http"):
        PopConfig("x", 0.0, 0.0, ("tcp://a:1",))
    with pytest.raises(RouterError, match="'ams'"):
        PopRegistry(pops(), here="ams", heartbeat_interval_s=1.0)
    with pytest.raises(RouterError, match="in PoPs"):
        PopRegistry([*pops(), PopConfig("ams", 52.4, 4.9, (FRA,))], "fra", 1.0)


def test_unknown_daemon_and_wrong_pop_are_ignored(reg: PopRegistry) -> None:
    assert reg.update(hb(url="http://ghost:8000"), 0.0) == "unknown_daemon"
    assert reg.update(hb(pop="nyc"), 0.0) == "pop_mismatch"
    assert state(reg, FRA, 0.0) == "no_heartbeat"
    # Trailing slashes do not split one daemon into two identities.
    assert reg.update(hb(url=NYC, pop="nyc"), 0.0) == "accepted"


def test_stale_after_three_periods_and_back_when_it_speaks(reg: PopRegistry) -> None:
    reg.update(hb(seq=1), 10.0)
    assert state(reg, FRA, 10.0 + 3 * PERIOD) == "up"
    view = next(v for v in reg.snapshot(10.0 + 3 * PERIOD + 0.01) if v.url == FRA)
    assert (view.available, view.state) == (False, "stale")
    assert view.reason == "heartbeats stopped"
    reg.update(hb(seq=2), 20.0)
    assert state(reg, FRA, 20.0) == "up"


def test_draining_full_and_admin_drains_are_excluded(reg: PopRegistry) -> None:
    reg.update(hb(seq=1, draining=True), 0.0)
    assert state(reg, FRA, 0.0) == "draining"
    reg.update(hb(seq=2, kv_blocks_free=0), 0.0)
    assert state(reg, FRA, 0.0) == "kv_full"
    reg.update(hb(seq=3), 0.0)
    reg.drain_daemon(FRA)
    assert state(reg, FRA, 0.0) == "admin_drained"
    reg.undrain_daemon(FRA + "/")
    reg.drain_pop("fra")
    assert state(reg, FRA, 0.0) == "pop_drained" and reg.pop_drained("fra")
    reg.undrain_pop("fra")
    assert state(reg, FRA, 0.0) == "up"
    with pytest.raises(RouterError, match="'ams'"):
        reg.drain_pop("ams")
    with pytest.raises(RouterError, match="http://nope:1"):
        reg.drain_daemon("http://nope:1")


def test_placeable_sees_a_drain_made_after_the_snapshot(reg: PopRegistry) -> None:
    """The proxy's last check before sending: a drain between select() and the send counts."""
    reg.update(hb(seq=1), 0.0)
    reg.snapshot(0.0)
    assert reg.placeable([FRA], 0.0)
    reg.drain_daemon(FRA)
    assert not reg.placeable([FRA], 0.0)
    assert not reg.placeable([NYC], 0.0)  # never heard from: not placeable either
    assert not reg.placeable(["http://unknown:1"], 0.0)
    reg.undrain_daemon(FRA)
    assert reg.placeable([FRA], 0.0)


def test_mark_down_lasts_until_the_next_heartbeat(reg: PopRegistry) -> None:
    reg.update(hb(seq=1), 0.0)
    reg.mark_down(FRA, 0.5)
    reg.mark_down("http://removed-by-reload:1", 0.5)  # ignored, not an error
    assert state(reg, FRA, 0.5) == "down"
    reg.update(hb(seq=2), 1.0)
    assert state(reg, FRA, 1.0) == "up"


def test_out_of_order_and_restarts(reg: PopRegistry) -> None:
    assert reg.update(hb(seq=5), 0.0) == "accepted"
    assert reg.update(hb(seq=4, running=9), 0.1) == "out_of_order"
    assert reg.update(hb(seq=5), 0.1) == "out_of_order"
    assert reg.update(hb(seq=0, started_at=200.0), 0.2) == "restart"
    # A late message of the previous incarnation cannot roll the state back.
    assert reg.update(hb(seq=6, started_at=100.0), 0.3) == "out_of_order"
    # Once stale, anything goes: a restart with the clock stepped back is heard again.
    assert reg.update(hb(seq=0, started_at=50.0), 10.0) == "restart"
    assert state(reg, FRA, 10.0) == "up"


def test_snapshot_is_reused_until_something_changes(reg: PopRegistry) -> None:
    reg.update(hb(seq=1), 0.0)
    first = reg.snapshot(0.0)
    assert reg.snapshot(0.5) is first
    reg.update(hb(url=NYC, pop="nyc", seq=1), 0.6)
    second = reg.snapshot(0.6)
    assert second is not first
    assert second[0] is first[0]  # the unchanged daemon keeps its view object
    assert reg.snapshot(3.5) is not second  # FRA's freshness deadline passed


def test_replace_pops_keeps_remaining_daemons(reg: PopRegistry) -> None:
    reg.update(hb(seq=1), 0.0)
    reg.drain_pop("nyc")
    reg.record_rtt("fra", 0.01)
    reg.replace_pops([PopConfig("fra", 50.11, 8.68, (FRA,)), PopConfig("ams", 52.37, 4.9)])
    assert [p.name for p in reg.pops()] == ["fra", "ams"]
    assert state(reg, FRA, 0.0) == "up"
    assert reg.rtt("fra") == 0.01
    assert not reg.pop_drained("ams")
    assert [d.url for d in reg.daemons()] == [FRA]
    with pytest.raises(RouterError, match="'nyc'"):
        reg.rtt("nyc")


def test_rtt_ewma_and_in_flight(reg: PopRegistry) -> None:
    reg.record_rtt("nyc", 0.100)
    reg.record_rtt("nyc", 0.200)
    assert reg.rtt("nyc") == pytest.approx(0.130)
    reg.record_rtt("gone", 1.0)  # a probe that outlived a reload: ignored
    assert reg.rtt("fra") is None
    reg.update(hb(seq=1, in_flight=3), 0.0)
    assert reg.in_flight("fra", 1.0) == 3
    assert reg.in_flight("fra", 10.0) == 0  # a silent daemon's count does not linger
    view = next(v for v in reg.snapshot(0.0) if v.pop == "nyc")
    assert view.rtt_s == pytest.approx(0.130) and view.lat == 40.71


def heard(reg: PopRegistry, beat: Heartbeat, now: float) -> str:
    """A heartbeat arrives and the next decision's snapshot includes it."""
    verdict = reg.update(beat, now)
    reg.snapshot(now)
    return verdict


def test_pending_placements_count_until_a_heartbeat_includes_them(reg: PopRegistry) -> None:
    """PERIOD 1 s: daemons refresh their load snapshot every 0.5 s (the report lag)."""
    heard(reg, hb(seq=1), 0.0)
    ledger = reg.pending
    ledger.record(10.0, FRA, None, prompt_tokens=800, kv_tokens=1000, decode_lag_s=0.1,
                  prefill_lag_s=0.1, prefill_s=0.1)  # fmt: skip
    assert tuple(ledger.totals(FRA)) == (1.0, 1000.0, 800.0)
    # Too soon for the request to be at the daemon and back: it counts in full.
    heard(reg, hb(seq=2), 10.05)
    assert tuple(ledger.totals(FRA)) == (1.0, 1000.0, 800.0)
    # Halfway through the snapshot's possible age: shown with probability 1/2.
    heard(reg, hb(seq=3), 10.35)
    assert ledger.totals(FRA)[0] == pytest.approx(0.5)
    # Older than the lag and the whole report lag: every heartbeat now includes it.
    heard(reg, hb(seq=4), 10.6)
    assert tuple(ledger.totals(FRA)) == (0.0, 0.0, 0.0)


def test_an_earlier_heartbeat_never_brings_a_placement_back(reg: PopRegistry) -> None:
    """A placement's weight is the chance that no heartbeat so far has shown it: it only falls,
    and each daemon's heartbeats absorb only its own part of a placement."""
    heard(reg, hb(seq=1), 0.0)
    reg.pending.record(10.0, FRA, NYC, 2000, 2100, 0.0, 0.2, 0.25)
    heard(reg, hb(seq=2), 10.25)  # FRA: shown with probability 1/2
    assert tuple(reg.pending.totals(FRA)) == pytest.approx((0.5, 1050.0, 0.0))
    assert tuple(reg.pending.totals(NYC)) == (0.0, 0.0, 2000.0)  # a prefill peer: tokens only
    heard(reg, hb(seq=3), 10.26)
    assert reg.pending.totals(FRA)[0] == pytest.approx(0.48)
    heard(reg, hb(url=NYC, pop="nyc", seq=1), 10.15)  # NYC's own lag has not passed
    assert tuple(reg.pending.totals(NYC)) == (0.0, 0.0, 2000.0)


def test_cancel_restart_and_reload_forget_pending(reg: PopRegistry) -> None:
    heard(reg, hb(seq=1), 0.0)
    ticket = reg.pending.record(1.0, FRA, NYC, 500, 600, 0.1, 0.2, 0.06)
    reg.pending.cancel(ticket)  # the connect failed: it never got there
    assert tuple(reg.pending.totals(FRA)) == tuple(reg.pending.totals(NYC)) == (0.0, 0.0, 0.0)
    reg.pending.cancel(ticket)  # twice is harmless
    reg.pending.record(2.0, FRA, NYC, 500, 600, 0.1, 0.2, 0.06)
    assert heard(reg, hb(seq=1, started_at=200.0), 2.01) == "restart"
    assert tuple(reg.pending.totals(FRA)) == (0.0, 0.0, 0.0)  # the new process lost them
    assert reg.pending.totals(NYC)[2] == 500.0
    reg.replace_pops([PopConfig("fra", 50.11, 8.68, (FRA,)), PopConfig("ams", 52.37, 4.9)])
    assert tuple(reg.pending.totals(NYC)) == (0.0, 0.0, 0.0)


def test_load_only_snapshots_name_what_changed_and_readers_trim_the_journal(
    reg: PopRegistry,
) -> None:
    reg.update(hb(seq=1), 0.0)
    first = reg.snapshot(0.0)
    assert first.base is None and first.changed is None  # the first: anything changed
    first.derived["x"] = object()  # a reader derived something from it
    v0 = reg.pending.version
    reg.pending.record(0.1, FRA, None, 100, 200, 0.1, 0.1, 0.01)
    assert reg.snapshot(0.1) is first  # placements do not change the snapshot...
    assert reg.pending.changes_since(v0) == [(FRA, 1.0, 200.0, 100.0, 0.1)]  # ...journaled
    reg.update(hb(seq=2, running=3), 0.2)
    second = reg.snapshot(0.2)
    assert second.base is first and second.changed == {FRA}  # load only: carry from `first`
    assert reg.pending.changes_since(v0) is not None  # kept until readers catch up
    reg.pending.trim_to(reg.pending.version)
    assert reg.pending.changes_since(v0) is None  # readers older than that rebuild
    assert reg.pending.changes_since(reg.pending.version) == []
    reg.update(hb(seq=3, running=4), 0.3)
    third = reg.snapshot(0.3)  # nothing was derived from `second`: from what it came from
    assert third.base is first and third.changed == {FRA} and second.base is None
    reg.update(hb(seq=4, draining=True), 0.4)
    assert reg.snapshot(0.4).changed is None  # availability changed: anything may have


def test_load_only_heartbeats_are_coalesced_availability_changes_are_not() -> None:
    reg = PopRegistry(pops(), here="fra", heartbeat_interval_s=PERIOD, coalesce_s=0.05)
    reg.update(hb(seq=1), 0.0)
    first = reg.snapshot(0.0)
    reg.pending.record(0.0, FRA, None, 100, 200, 0.0, 0.0, 0.01)
    reg.update(hb(seq=2, running=5), 0.6)
    held = reg.snapshot(0.6)  # the first snapshot at 0.6 s: the load change is in
    assert held is not first and next(v for v in held if v.url == FRA).running == 5
    assert tuple(reg.pending.totals(FRA)) == (0.0, 0.0, 0.0)  # ...and absorbed with it
    reg.pending.record(0.61, FRA, None, 100, 200, 0.0, 0.0, 0.01)
    reg.update(hb(seq=3, running=7), 0.62)
    assert reg.snapshot(0.63) is held  # within 50 ms of the last build: waits...
    assert reg.pending.totals(FRA)[0] == 1.0  # ...and so does the absorption
    assert next(v for v in reg.snapshot(0.66) if v.url == FRA).running == 7
    reg.update(hb(url=NYC, pop="nyc", seq=1), 0.67)  # a first heartbeat: NYC becomes placeable
    assert next(v for v in reg.snapshot(0.67) if v.url == NYC).available
    reg.drain_pop("nyc")
    assert not next(v for v in reg.snapshot(0.68) if v.url == NYC).available
