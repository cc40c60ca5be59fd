"""Named columns of the selector's load arrays (:mod:`edgeinfer.router.load_arrays`): the
build's matrices read from the heartbeats (``DCol``, ``PCol``), the raw load kept per decode
daemon between placements (``DLoad``, ``Totals``), a decode daemon's row as a decision reads it
(``Row``), and the arrays the compiled decision takes (:mod:`edgeinfer.router.candidate_cut`:
``DState``, ``PState``)."""

from __future__ import annotations

from enum import IntEnum


class DCol(IntEnum):
    """Columns of the per-snapshot decode-daemon matrix (one row per D)."""

    RUNNING, WAITING, FREE_TOKENS, PREFILL_RATE, DECODE_RATE, QUEUED_PREFILL = range(6)
    PENDING_PREFILL_S, REPORTED_AT, RTT_S, ITL_P50_S, LOCAL_MAX_TOKENS, POP, MEASURED = range(6, 13)
    PENDING_END = 13  # PlacementLedger.prefill_end (-inf: nothing pending)


class PCol(IntEnum):
    """Columns of the per-snapshot prefill-daemon matrix (one row per P)."""

    RATE, QUEUED_PREFILL, PENDING_PREFILL_S, REPORTED_AT, POP, PENDING_END = range(6)


class DLoad(IntEnum):
    """Columns of ``LoadArrays.d_load``: a decode daemon's load as placements change it
    (:mod:`edgeinfer.router.load_update`), then what is derived from it besides its row."""

    RUNNING, WAITING, FREE_TOKENS, DECODE_RATE, ITL_P50_S = range(5)
    MEASURED = 5  # 1.0 when the daemon measured its decode rate
    LOCAL_MAX_TOKENS = 6  # the longest prompt it prefills itself: inf for a `both`
    LOCAL_S_PER_TOKEN, LOCAL_END = 7, 8  # its own prefill rate and queue end
    STATIC = 9  # SLO penalty plus admission wait: the keys' part without prefill
    OWN_SHORT, OWN_LONG = 10, 11  # its cheapest prefill of its own, short and long prompts
    LOAD = 12  # running + waiting, for the power-of-two choice and the load guard


class Totals(IntEnum):
    """Entries of ``LoadArrays.totals``: figures over all rows, kept with them."""

    POOLED_SHORT, POOLED_LONG = 0, 1  # the cheapest pooled prefill, short and long prompts
    LOAD_SUM = 2  # the sum of DLoad.LOAD (the load guard's mean): counts, so sums are exact


class Row(IntEnum):
    """Fields of a decode daemon's row (``LoadArrays.row_arr``), what a decision reads."""

    FREE_TOKENS = 0  # -1 when requests wait
    ADMIT_WAIT_S = 1
    LOCAL_END = 2  # when its own prefill queue ends
    LOCAL_S_PER_TOKEN = 3
    LOCAL_MAX_TOKENS = 4  # the longest prompt (suffix) it prefills itself: inf for a `both`
    COLO_END = 5  # its co-located prefill peer's queue end (inf: none)
    COLO_S_PER_TOKEN = 6
    PENALTY = 7  # 0, or BIG + itl over the SLO
    ITL_S = 8


class DState(IntEnum):
    """Columns of ``LoadArrays.d_state`` past the Row fields: what the compiled decision
    reads of each D in one array (:mod:`edgeinfer.router.candidate_cut`)."""

    KEY_SHORT = len(Row)  # pruning keys, see _keys
    KEY_LONG = len(Row) + 1
    X, Y, Z = len(Row) + 2, len(Row) + 3, len(Row) + 4  # the PoP's unit vector
    MEASURED_RTT_S = len(Row) + 5  # the router's RTT to the PoP, 0: none


class PState(IntEnum):
    """Columns of ``LoadArrays.pool_state``, one row per pool member."""

    END, S_PER_TOKEN = range(2)
