"""The selector's load arrays kept current between heartbeats: updated per placement, carried
to the next snapshot, given back when a placement is cancelled; each time equal to arrays built
afresh from the same heartbeats and ledger. (The compiled update on hand-built arrays:
``test_router_load_update.py``.)"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from edgeinfer.router import load_arrays
from edgeinfer.router.geo import GeoPoint
from edgeinfer.router.load_columns import DLoad, DState
from edgeinfer.router.prepared import prepared
from edgeinfer.router.selector import RequestFeatures, record_placement, select
from test_router_selector import CFG, COORDS, LONDON, NET, World


def test_updates_per_placement_match_a_rebuild() -> None:
    """The arrays updated row by row equal arrays built afresh from the same ledger."""
    daemons = {
        "lon": ("http://lon-d:8000", "http://lon-p1:8000", "http://lon-p2:8000"),
        "sea": ("http://sea-d:8000", "http://sea-p:8000", "http://sea-b:8000"),
        "cgq": ("http://cgq-b:8000",),
    }
    w = World(daemons)
    for urls in daemons.values():
        for url in urls:
            role = url.split("-")[1][0]
            w.beat(url, role={"d": "decode", "p": "prefill", "b": "both"}[role],
                   queued_prefill_tokens=1000 * len(url) % 7000)  # fmt: skip
    now = w.now
    rng = random.Random(3)
    views = w.reg.snapshot(now)
    for _ in range(60):
        f = RequestFeatures(rng.choice([100, 900, 5000, 20_000]), 200, "m")
        client = GeoPoint(*COORDS[rng.choice(list(COORDS))])
        best = select(views, client, f, NET, CFG, rng, "lon", pending=w.reg.pending, now=now)[0]
        record_placement(w.reg.pending, best, f, now)
    live = prepared(views, NET, CFG, w.reg.pending).arrays("m", now)
    fresh = load_arrays.LoadArrays(views, "m", live.geo, CFG, w.reg.pending, now)
    assert live.version == fresh.version
    np.testing.assert_allclose(live.p_end, fresh.p_end)
    np.testing.assert_allclose(live.pool_state, fresh.pool_state)  # the pool's copy, kept equal
    # Co-located peers are chosen per snapshot: compare the rows whose peer a rebuild keeps.
    same = np.asarray(live.colo) == np.asarray(fresh.colo)
    assert same.sum() >= len(same) - 2
    np.testing.assert_allclose(live.row_arr[same], fresh.row_arr[same])
    raw_l, raw_f = live.d_load, fresh.d_load
    np.testing.assert_allclose(raw_l[:, : DLoad.OWN_SHORT], raw_f[:, : DLoad.OWN_SHORT])
    np.testing.assert_allclose(raw_l[same, DLoad.OWN_SHORT :], raw_f[same, DLoad.OWN_SHORT :])
    assert live.load_sum == pytest.approx(fresh.load_sum)
    # The pruning keys may lag the pool's minima, but only downwards: still lower bounds.
    assert np.all(live.totals <= fresh.totals + 1e-9)
    for key in (DState.KEY_SHORT, DState.KEY_LONG):
        assert np.all(live.d_state[:, key] <= fresh.d_state[:, key] + 1e-9)


def test_placements_cancelled_give_back_their_load_as_a_rebuild_reads_it() -> None:
    """Work taken back (placements cancelled) lowers the pool's queues, the pooled bounds and
    with them every pruning key: the updated arrays equal a rebuild's, keys included."""
    daemons = {
        "lon": ("http://lon-d:8000", "http://lon-p1:8000"),
        "sea": ("http://sea-d:8000", "http://sea-p:8000"),
        "cgq": ("http://cgq-d:8000",),
    }
    w = World(daemons)
    for urls in daemons.values():
        for url in urls:
            role = {"d": "decode", "p": "prefill"}[url.split("-")[1][0]]
            w.beat(url, role=role, local_prefill_threshold=0)
    pending, now = w.reg.pending, w.now
    idle = prepared(w.reg.snapshot(now), NET, CFG, pending).arrays("m", now).totals.copy()
    rng, tickets = random.Random(6), []
    for k in range(8):
        views = w.reg.snapshot(now)
        f = RequestFeatures(20_000, 200, "m")  # long: prefilled by the pool
        client = GeoPoint(*COORDS[("lon", "sea")[k % 2]])
        best = select(views, client, f, NET, CFG, rng, "lon", pending=pending, now=now)[0]
        tickets.append(record_placement(pending, best, f, now))
    # A load-only heartbeat: the carried arrays choose the pool again, bounds from its queues.
    w.beat("http://lon-d:8000", role="decode")
    views = w.reg.snapshot(now)
    live = prepared(views, NET, CFG, pending).arrays("m", now)
    assert np.all(live.totals[:2] > idle[:2])  # every pool member has work queued
    for ticket in tickets:
        pending.cancel(ticket)
    assert prepared(views, NET, CFG, pending).arrays("m", now) is live
    assert live.totals[:2].tolist() == idle[:2].tolist()  # the bounds came down
    fresh = load_arrays.LoadArrays(views, "m", live.geo, CFG, pending, now)
    for name in ("d_state", "d_load", "p_state", "pool_state", "totals"):
        np.testing.assert_allclose(getattr(live, name), getattr(fresh, name), err_msg=name)


def test_arrays_carried_to_a_load_only_snapshot_match_a_rebuild() -> None:
    """A snapshot that differs only in the load a few daemons reported carries the arrays over
    (the same object: the journal applied, those daemons read again, peers, pool and rows
    derived again) and they equal arrays built afresh; a change of availability builds them
    afresh, and so does age."""
    daemons = {
        "lon": ("http://lon-d:8000", "http://lon-p1:8000", "http://lon-p2:8000"),
        "sea": ("http://sea-d:8000", "http://sea-p:8000", "http://sea-b:8000"),
        "cgq": ("http://cgq-b:8000",),
    }
    roles = {"d": "decode", "p": "prefill", "b": "both"}
    w = World(daemons)
    for urls in daemons.values():
        for url in urls:
            w.beat(url, role=roles[url.split("-")[1][0]], queued_prefill_tokens=500)
    rng = random.Random(4)

    def decide(n: int) -> load_arrays.LoadArrays:
        for _ in range(n):
            views = w.reg.snapshot(w.now)
            f = RequestFeatures(rng.choice([100, 900, 5000]), 200, "m")
            client = GeoPoint(*COORDS[rng.choice(list(COORDS))])
            best = select(views, client, f, NET, CFG, rng, "lon", pending=w.reg.pending,
                          now=w.now)[0]  # fmt: skip
            record_placement(w.reg.pending, best, f, w.now)
        return prepared(views, NET, CFG, w.reg.pending).arrays("m", w.now)

    before = decide(30)
    chosen = (list(before.colo), before.pool_list)
    # New load from two decode-capable daemons and a prefill daemon, at the same instant (a
    # build clamps a queue's end that has passed to now, the carried arrays keep it: the same
    # price, not the same number).
    w.beat("http://sea-b:8000", role="both", running=9, queued_prefill_tokens=20_000,
           prefill_tokens_per_s=8000.0, decode_tokens_per_s=700.0, itl_p50_s=0.02)  # fmt: skip
    w.beat("http://lon-d:8000", role="decode", running=1, kv_blocks_free=3000)
    w.beat("http://lon-p2:8000", role="prefill", queued_prefill_tokens=4000)
    views = w.reg.snapshot(w.now)
    assert views.changed == {"http://sea-b:8000", "http://lon-d:8000", "http://lon-p2:8000"}
    live = prepared(views, NET, CFG, w.reg.pending).arrays("m", w.now)
    assert live is before  # carried over, not built again
    fresh = load_arrays.LoadArrays(views, "m", live.geo, CFG, w.reg.pending, w.now)
    assert live.colo == fresh.colo and live.pool_list == fresh.pool_list
    assert (live.colo, live.pool_list) != chosen  # chosen again for the new load
    assert live.d == fresh.d and live.p == fresh.p
    for name in ("d_state", "p_state", "pool_state", "totals"):
        np.testing.assert_allclose(getattr(live, name), getattr(fresh, name), err_msg=name)
    # The raw load too, but for the ITL median: a row that reported none is assumed its peers',
    # and a row not read again keeps the figure its build assumed (here a row that prices its
    # ITL from its measured rate, not from the median).
    kept = [c for c in DLoad if c is not DLoad.ITL_P50_S]
    np.testing.assert_allclose(live.d_load[:, kept], fresh.d_load[:, kept])
    assert live.p_inv_l == live.p_inv.tolist()  # the prefix path's copy, kept equal
    assert decide(10) is live  # and decisions go on with them

    w.now += 0.3
    w.beat("http://sea-d:8000", role="decode", draining=True)  # availability: a full build
    assert w.reg.snapshot(w.now).changed is None
    assert decide(1) is not live
    w.now += load_arrays.REBUILD_S  # load only, but the carried build is too old: again
    w.beat("http://lon-d:8000", role="decode", running=2)
    rebuilt = decide(1)
    w.now += 0.3
    w.beat("http://lon-d:8000", role="decode", running=3)
    assert decide(1) is rebuilt


def test_carried_and_rebuilt_arrays_price_a_queue_alike_as_time_passes() -> None:
    """A daemon works its reported queue, then what this router placed since, in order (a
    FIFO): carried arrays, updated per placement, and arrays built afresh from the ledger price
    the same queue, that FIFO's, some time later. (A build once let the pending work drain
    beside the reported queue, so a busy daemon's queue was priced anew at every rebuild.)"""
    w = World()
    for pop in COORDS:
        w.beat(f"http://{pop}-1:8000", queued_prefill_tokens=20_000)  # 2 s of work each
    pending, rng = w.reg.pending, random.Random(5)
    for _ in range(4):
        views = w.reg.snapshot(w.now)
        f = RequestFeatures(5000, 100, "m")
        best = select(views, LONDON, f, NET, CFG, rng, "lon", pending=pending, now=w.now)[0]
        record_placement(pending, best, f, w.now)
        w.now += 0.05
    w.now += 0.6  # within REBUILD_S of the build, which a carry needs
    w.beat("http://cgq-1:8000")  # a load-only snapshot: the arrays are carried over
    views = w.reg.snapshot(w.now)
    live = prepared(views, NET, CFG, pending).arrays("m", w.now)
    assert live.built_at is not None and live.built_at < w.now  # carried, not built
    fresh = load_arrays.LoadArrays(views, "m", live.geo, CFG, pending, w.now)
    t = w.now

    def queues(ends: Any) -> np.ndarray:
        return np.maximum(np.asarray(ends, dtype=np.float64) - t, 0.0)

    local = [x.d_load[:, DLoad.LOCAL_END] for x in (live, fresh)]
    np.testing.assert_allclose(queues(local[0]), queues(local[1]), atol=1e-9)
    np.testing.assert_allclose(queues(live.p_end), queues(fresh.p_end), atol=1e-9)
    # And that is the FIFO: the reported queue from its report, then the pending back to back.
    lon = next(i for i, v in enumerate(fresh.d) if v.pop == "lon")
    v = fresh.d[lon]
    inv = 1.0 / v.prefill_tokens_per_s
    reported = v.last_seen - pending.report_lag_s / 2 + v.queued_prefill_tokens * inv
    fifo = max(reported + pending.totals(v.url)[2] * inv, pending.prefill_end(v.url), t) - t
    assert pending.totals(v.url)[2] > 0  # something was placed there
    assert queues(local[0])[lon] == pytest.approx(fifo)
