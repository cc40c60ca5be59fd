"""The compiled per-placement update (router/load_update.py) on hand-built arrays: what one
change moves, which rows it derives again, and the pruning keys when the pool's bounds fall."""

from __future__ import annotations

import math

import numpy as np
import pytest

from edgeinfer.router.load_columns import DLoad, DState, PState, Row, Totals
from edgeinfer.router.load_update import BIG, apply_change, derive_row, pooled_bounds

ITL_SLO, MEAN_OUT, NS, NL = 0.05, 200.0, 512.0, 8192.0


def world() -> dict[str, np.ndarray]:
    """Three decode rows and two prefill rows at t = 0. Row 0 prefills locally; rows 1 and 2
    have prefill 0 as their co-located peer; row 2 prefills nothing itself (a decode daemon
    with no local prefill). Both prefill rows are the pool."""
    d_load = np.zeros((3, len(DLoad)))
    for i in range(3):
        d_load[i, : DLoad.STATIC] = (2.0, 0.0, 10_000.0, 1000.0, 0.02, 1.0, math.inf, 1e-4, 0.0)
    d_load[2, DLoad.LOCAL_MAX_TOKENS] = 0.0
    p_state = np.array([[0.5, 2e-4], [0.0, 1e-4]])
    pool = p_state.copy()
    totals = np.zeros(len(Totals))
    totals[: Totals.LOAD_SUM] = pooled_bounds(pool, 0.0, NS, NL)
    w = {
        "d_load": d_load, "d_state": np.zeros((3, len(Row) + len(DState))),
        "colo": np.array([-1, 0, 0], np.intp), "colo_ptr": np.array([0, 2, 2], np.intp),
        "colo_rows": np.array([1, 2], np.intp), "p_state": p_state,
        "p_pool": np.array([0, 1], np.intp), "pool": pool, "totals": totals,
    }  # fmt: skip
    for i in range(3):
        derive(w, i, 0.0)
    return w


def derive(w: dict[str, np.ndarray], i: int, t: float) -> None:
    derive_row(i, t, w["d_load"], w["d_state"], w["colo"], w["p_state"], w["totals"], ITL_SLO,
               MEAN_OUT, NS, NL)  # fmt: skip


def change(w: dict[str, np.ndarray], i: int, j: int, seqs: float, kv: float, prefill: float,
           t: float) -> None:  # fmt: skip
    apply_change(i, j, seqs, kv, prefill, t, w["d_load"], w["d_state"], w["colo"], w["colo_ptr"],
                 w["colo_rows"], w["p_state"], w["p_pool"], w["pool"], w["totals"], ITL_SLO,
                 MEAN_OUT, NS, NL)  # fmt: skip


def test_a_row_is_derived_from_its_raw_load() -> None:
    w = world()
    row, raw = w["d_state"][1], w["d_load"][1]
    itl = 3.0 / 1000.0  # (running + 1) / rate: measured
    assert row[Row.ITL_S] == pytest.approx(itl) and row[Row.PENALTY] == 0.0
    assert row[Row.COLO_END] == 0.5 and row[Row.COLO_S_PER_TOKEN] == 2e-4
    assert raw[DLoad.OWN_SHORT] == pytest.approx(min(NS * 1e-4, 0.5 + NS * 2e-4))
    assert raw[DLoad.LOAD] == 2.0 and w["totals"][Totals.LOAD_SUM] == 6.0
    # Row 2 has no prefill of its own but its peer: its keys are the peer's or the pool's.
    assert w["d_state"][2, DState.KEY_SHORT] == pytest.approx(min(0.5 + NS * 2e-4, NS * 1e-4))
    # Over the SLO: the penalty ranks it after every row within it.
    w["d_load"][0, DLoad.RUNNING] = 99.0
    derive(w, 0, 0.0)
    assert w["d_state"][0, Row.PENALTY] == pytest.approx(BIG + 0.1)


def test_a_placement_moves_its_decode_row_and_the_rows_its_prefill_peer_serves() -> None:
    w = world()
    before = w["d_state"].copy()
    # A remote prefill of 1000 tokens on P 0 at t = 1 (its queue ended at 0.5: it starts now),
    # then the decode side of the same placement on row 0.
    change(w, -1, 0, 0.0, 0.0, 1000.0, 1.0)
    assert w["p_state"][0, PState.END] == pytest.approx(1.0 + 1000 * 2e-4)
    assert w["pool"][0, PState.END] == w["p_state"][0, PState.END]
    np.testing.assert_array_equal(w["d_state"][0], before[0])  # not P 0's
    for i in (1, 2):  # their co-located peer's queue, read again
        assert w["d_state"][i, Row.COLO_END] == pytest.approx(1.2)
    change(w, 0, -1, 1.0, 1128.0, 0.0, 1.0)
    assert w["d_load"][0, DLoad.RUNNING] == 3.0 and w["d_load"][0, DLoad.FREE_TOKENS] == 8872.0
    assert w["totals"][Totals.LOAD_SUM] == 7.0
    # More work raised no pooled bound: they stay lower bounds, unchanged.
    assert w["totals"][: Totals.LOAD_SUM].tolist() == list(pooled_bounds(w["pool"], 0.0, NS, NL))


def test_work_taken_back_lowers_the_bounds_and_every_rows_keys() -> None:
    w = world()
    # The pool's bounds as a carry computes them with P 1 busy until t = 3.
    w["p_state"][1, PState.END] = w["pool"][1, PState.END] = 3.0
    w["totals"][: Totals.LOAD_SUM] = pooled_bounds(w["pool"], 0.0, NS, NL)
    for i in range(3):
        derive(w, i, 0.0)
    high = w["d_state"][:, DState.KEY_LONG].copy()
    # The 30,000 tokens behind that queue are cancelled: P 1 is idle again.
    change(w, -1, 1, 0.0, 0.0, -30_000.0, 0.0)
    assert w["p_state"][1, PState.END] == pytest.approx(0.0)
    short, long = pooled_bounds(w["pool"], 0.0, NS, NL)
    assert w["totals"][Totals.POOLED_LONG] == long < high[2]
    # Row 2 was not derived again (its peer is P 0), yet its keys follow the new bound.
    raw = w["d_load"]
    for i in range(3):
        assert w["d_state"][i, DState.KEY_LONG] == raw[i, DLoad.STATIC] + min(
            raw[i, DLoad.OWN_LONG], long
        )
        assert w["d_state"][i, DState.KEY_SHORT] == raw[i, DLoad.STATIC] + min(
            raw[i, DLoad.OWN_SHORT], short
        )
    assert w["d_state"][2, DState.KEY_LONG] < high[2]
