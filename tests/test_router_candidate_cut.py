"""The compiled candidate passes against plain numpy: the same daemons, RTTs and prices.

``cheapest`` skips daemons on a chord bound instead of computing every RTT floor; whatever it
skips, its answer must be what ranking every daemon by ``RTT floor + key`` gives. And
``price_candidates`` must price as ``NetworkModel``'s formulas do (one definition of the network
model: the pass mirrors ``kv_exposed_s`` and ``rtt_floor_to_point_s``, these tests hold them to
it).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from edgeinfer.router.candidate_cut import (
    ADMIT,
    ITL,
    KEY_SHORT,
    NET,
    POOL_KV,
    POOLED,
    PREFILL,
    ROW,
    SCORE,
    ClientRtt,
    cheapest,
    price_candidates,
    unit_vector,
)
from edgeinfer.router.load_columns import DState, PState, Row
from edgeinfer.router.network import NetworkModel, unit_vectors

MODEL = NetworkModel()


def world(seed: int, n: int, pool: int = 5) -> dict[str, np.ndarray]:
    """``n`` decode daemons on a few shared PoPs (equal RTTs, so ties happen), random loads."""
    rng = np.random.default_rng(seed)
    pops = max(1, n // 2)
    lat, lon = rng.uniform(-60, 70, pops), rng.uniform(-180, 180, pops)
    at = rng.integers(0, pops, n)
    xyz = unit_vectors(lat, lon)[at]
    rows = np.zeros((n, len(Row)))
    rows[:, Row.FREE_TOKENS] = rng.choice([-1.0, 500.0, 50_000.0], n)
    rows[:, Row.ADMIT_WAIT_S] = rng.uniform(0, 2, n)
    rows[:, Row.LOCAL_END] = rng.uniform(0, 3, n)
    rows[:, Row.LOCAL_S_PER_TOKEN] = rng.uniform(5e-5, 2e-4, n)
    rows[:, Row.LOCAL_MAX_TOKENS] = rng.choice([512.0, math.inf], n)
    rows[:, Row.COLO_END] = np.where(rng.random(n) < 0.3, math.inf, rng.uniform(0, 3, n))
    rows[:, Row.COLO_S_PER_TOKEN] = np.where(np.isinf(rows[:, Row.COLO_END]), 0.0, 1e-4)
    rows[:, Row.PENALTY] = np.where(rng.random(n) < 0.1, 1e6, 0.0)
    rows[:, Row.ITL_S] = rng.uniform(0.01, 0.2, n)
    members = unit_vectors(rng.uniform(-60, 70, pool), rng.uniform(-180, 180, pool))
    rtt = MODEL.rtt_floor_from_dot_s(xyz @ members.T)
    rtt[rng.random((n, pool)) < 0.2] = 0.0  # the member shares the daemon's PoP
    d = np.zeros((n, len(Row) + len(DState)))
    d[:, : len(Row)] = rows
    d[:, DState.KEY_SHORT] = np.round(rng.uniform(0, 0.3, n), 2)  # rounded: equal keys
    d[:, DState.X : DState.Z + 1] = xyz
    d[:, DState.MEASURED_RTT_S] = np.where(rng.random(n) < 0.5, rng.uniform(0, 0.3, n), 0.0)
    state = np.stack((rng.uniform(0, 3, pool), rng.uniform(5e-5, 2e-4, pool)), axis=1)
    return {
        "d": d, "xyz": xyz, "key": d[:, DState.KEY_SHORT], "measured": d[:, DState.MEASURED_RTT_S],
        "rows": rows, "pool_rtt": rtt, "far": (rtt > 0).astype(np.float64), "pool_state": state,
        "pool_end": state[:, PState.END], "pool_inv": state[:, PState.S_PER_TOKEN],
    }  # fmt: skip


def numpy_rtt(w: dict[str, np.ndarray], lat: float, lon: float, inside: bool) -> np.ndarray:
    floor = MODEL.rtt_floor_to_point_s(w["xyz"], unit_vectors(lat, lon).tolist())
    return np.maximum(floor, w["measured"]) if inside else floor


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("inside", [False, True])
def test_cheapest_is_the_full_ranking(seed: int, inside: bool) -> None:
    n = [1, 3, 8, 9, 40, 400][seed % 6]
    w = world(seed, n)
    rng = np.random.default_rng(1000 + seed)
    lat, lon = float(rng.uniform(-89, 89)), float(rng.uniform(-180, 180))
    c = ClientRtt(w["d"], unit_vector(lat, lon), MODEL, inside)
    for k in (1, 8, 16):
        sel, rtt = c.cheapest(KEY_SHORT, k)
        ref = numpy_rtt(w, lat, lon, inside)
        cost = ref + w["key"]
        assert len(sel) == min(k, n)
        np.testing.assert_allclose(rtt, ref[sel], rtol=1e-12, atol=1e-15)
        # The k least costs, in order; which of several equal costs is the cut's own choice.
        np.testing.assert_allclose(cost[sel], np.sort(cost)[: len(sel)], rtol=1e-12, atol=1e-15)
        assert len(set(sel.tolist())) == len(sel)
    # Any row asked for alone gets the figure the pass gives it.
    fresh = ClientRtt(w["d"], unit_vector(lat, lon), MODEL, inside)
    for i in range(n):
        assert fresh(i) == pytest.approx(ref[i], rel=1e-12, abs=1e-15)
    sel, rtt = fresh.cheapest(KEY_SHORT, n)
    assert [fresh(i) for i in sel.tolist()] == rtt


def test_a_client_on_a_daemon_is_not_skipped() -> None:
    """A chord equal to its arc rounds a hair either way: a daemon where the client stands
    still makes the cut against one a hair further with the same key."""
    d = np.zeros((3, len(Row) + len(DState)))
    d[:, DState.X : DState.Z + 1] = unit_vectors(
        np.array([48.8566, 48.8566, 10.0]), np.array([2.3522, 2.35221, 0.0])
    )
    point = ClientRtt(d, unit_vector(48.8566, 2.3522), MODEL, False).point
    sel, rtt = cheapest(d, KEY_SHORT, *point, MODEL.s_per_radian, MODEL.fixed_rtt_s,
                        False, 1)  # fmt: skip
    assert sel.tolist() == [0]
    assert rtt[0] == pytest.approx(MODEL.fixed_rtt_s, abs=1e-6)  # the point shrunk: 9 metres


def reference_prices(w: dict[str, np.ndarray], rtt: np.ndarray, rows_at: list[int],
                     prompt: float, need: float, t: float) -> list[tuple[float, ...]]:  # fmt: skip
    """Each row priced as the selector's formulas state it, in numpy and NetworkModel."""
    link = MODEL.kv_link_s(prompt * 131_072)
    compute = prompt * w["pool_inv"]
    xfer = MODEL.kv_exposed_s(link, compute, prompt, 2048)
    out = []
    for i in rows_at:
        kv = w["far"][i] * xfer + w["pool_rtt"][i]
        total = kv + np.maximum(w["pool_end"] - t, 0.0) + compute
        b = int(total.argmin()) if len(total) else -1
        pooled = float(total[b]) if b >= 0 else math.inf
        r = w["rows"][i]
        lq = max(r[Row.LOCAL_END] - t, 0.0)
        local = (
            lq + prompt * r[Row.LOCAL_S_PER_TOKEN]
            if prompt <= r[Row.LOCAL_MAX_TOKENS]
            else math.inf
        )
        colo = max(r[Row.COLO_END] - t, 0.0) + prompt * r[Row.COLO_S_PER_TOKEN]
        best = min(local, colo, pooled)
        admit = 0.0 if r[Row.FREE_TOKENS] >= need else r[Row.ADMIT_WAIT_S]
        score = rtt[i] + admit + r[Row.PENALTY] + best if best < math.inf else math.inf
        out.append(
            (score, i, rtt[i], admit, best, r[Row.ITL_S], b, float(kv[b]) if b >= 0 else 0.0)
        )
    return out


@pytest.mark.parametrize("seed", range(30))
def test_price_candidates_prices_as_the_network_model(seed: int) -> None:
    n, pool = [5, 40, 300][seed % 3], [0, 1, 12][seed % 3 - 1]
    w = world(seed, n, pool)
    rng = np.random.default_rng(seed)
    lat, lon = float(rng.uniform(-60, 70)), float(rng.uniform(-180, 180))
    prompt = float(rng.choice([40, 600, 3000, 20_000]))
    need, t, k = prompt + 256, 1.0, 8
    c = ClientRtt(w["d"], unit_vector(lat, lon), MODEL, True)
    extra = int(rng.integers(0, n))
    got = price_candidates(
        w["d"], KEY_SHORT, w["pool_state"], w["pool_rtt"], *c.point, c.scale, c.fixed,
        True, k, extra, MODEL.kv_link_s(prompt * 131_072), 2048.0, prompt, need, t,
    )  # fmt: skip
    rtt = numpy_rtt(w, lat, lon, True)
    cut = c.cheapest(KEY_SHORT, k)[0].tolist()
    rows_at = cut + ([] if extra in cut else [extra])
    assert sorted(got[:, ROW].astype(int).tolist()) == sorted(rows_at)
    ref = {r[1]: r for r in reference_prices(w, rtt, rows_at, prompt, need, t)}
    for row in got.tolist():
        score, _, net, admit, best, itl, member, kv = ref[int(row[ROW])]
        assert row[SCORE] == pytest.approx(score, rel=1e-12)
        assert (row[NET], row[ADMIT], row[PREFILL], row[ITL]) == pytest.approx(
            (net, admit, best, itl), rel=1e-12
        )
        assert (row[POOLED], row[POOL_KV]) == pytest.approx((member, kv), rel=1e-12)
    scores = got[:, SCORE].tolist()
    assert scores == sorted(scores)
