"""One placement's change to the selector's load arrays, in one compiled call.

Every decision the router makes adds a placement to the ledger, and the next decision must price
it (:mod:`edgeinfer.router.inflight`): the decode daemon's sequences and KV, and the prompt on
whoever prefills it. Applying a change touches one or two raw rows, re-derives the decision rows
that read them (the decode daemon's, and those of the decode daemons whose co-located prefill
peer took the prompt) and, when a pool member's queue shrank, the pruning keys. In plain Python
over numpy scalars that was ~13 us a decision, as much as the decision's own compiled pass; here
it is one dispatch (~2 us).

A build derives every row with the same code (:func:`derive_all`), so a row updated placement by
placement and one built afresh from the same load are computed alike; a test holds the
per-placement updates to a rebuild.
"""

from __future__ import annotations

import math

import numpy as np

from edgeinfer.router.jit import compiled
from edgeinfer.router.load_columns import DLoad, DState, PState, Row, Totals
from edgeinfer.router.network import FloatArray, IntArray

BIG = 1e6  # added to the score of a candidate over the ITL SLO: it ranks after all within it

# The columns as plain ints, constants to the compiler.
_RUN, _WAITING, _FREE_T, _RATE = (int(DLoad.RUNNING), int(DLoad.WAITING),
                                  int(DLoad.FREE_TOKENS), int(DLoad.DECODE_RATE))  # fmt: skip
_P50, _MEAS, _LMAX = int(DLoad.ITL_P50_S), int(DLoad.MEASURED), int(DLoad.LOCAL_MAX_TOKENS)
_LINV, _LEND, _STATIC = int(DLoad.LOCAL_S_PER_TOKEN), int(DLoad.LOCAL_END), int(DLoad.STATIC)
_OWN_S, _OWN_L, _LOAD = int(DLoad.OWN_SHORT), int(DLoad.OWN_LONG), int(DLoad.LOAD)
_FREE, _WAIT, _L_END, _L_SPT = (int(Row.FREE_TOKENS), int(Row.ADMIT_WAIT_S), int(Row.LOCAL_END),
                                int(Row.LOCAL_S_PER_TOKEN))  # fmt: skip
_L_MAX, _C_END, _C_SPT = int(Row.LOCAL_MAX_TOKENS), int(Row.COLO_END), int(Row.COLO_S_PER_TOKEN)
_PENALTY, _ITL = int(Row.PENALTY), int(Row.ITL_S)
_K_SHORT, _K_LONG = int(DState.KEY_SHORT), int(DState.KEY_LONG)
_P_END, _P_SPT = int(PState.END), int(PState.S_PER_TOKEN)
_POOLED_S, _POOLED_L, _LOAD_SUM = (int(Totals.POOLED_SHORT), int(Totals.POOLED_LONG),
                                   int(Totals.LOAD_SUM))  # fmt: skip


@compiled
def derive_row(
    i: int, t: float, d_load: FloatArray, d_state: FloatArray, colo: IntArray,
    p_state: FloatArray, totals: FloatArray, itl_slo_s: float, mean_output: float, ns: float,
    nl: float,
) -> None:  # fmt: skip
    """Decode row ``i``'s derived load (``DLoad.STATIC`` on) and its decision row and keys in
    ``d_state`` from its raw load and its co-located peer's queue, at ``t``. ``ns``/``nl``:
    the pruning keys' reference prompts."""
    running, waiting, free = d_load[i, _RUN], d_load[i, _WAITING], d_load[i, _FREE_T]
    rate = d_load[i, _RATE]
    # Aggregate rate R at batch B means a step of B/R; one more sequence makes it (B+1)/R.
    itl = (running + 1.0) / rate if running > 0 and d_load[i, _MEAS] > 0 else d_load[i, _P50]
    penalty = 0.0 if itl <= itl_slo_s else BIG + itl
    admit_wait = (waiting + 1.0) * mean_output / rate
    static = penalty + admit_wait if waiting > 0 or free <= 0 else penalty
    local_inv, local_end, local_max = d_load[i, _LINV], d_load[i, _LEND], d_load[i, _LMAX]
    local_q = local_end - t if local_end > t else 0.0
    c = colo[i]
    if c >= 0:
        colo_end, colo_inv = p_state[c, _P_END], p_state[c, _P_SPT]
        colo_q = colo_end - t if colo_end > t else 0.0
    else:
        colo_end, colo_inv, colo_q = math.inf, 0.0, math.inf
    own_short = local_q + ns * local_inv if ns <= local_max else math.inf
    own_short = min(own_short, colo_q + ns * colo_inv)
    own_long = local_q + nl * local_inv if nl <= local_max else math.inf
    own_long = min(own_long, colo_q + nl * colo_inv)
    d_load[i, _STATIC], d_load[i, _OWN_S], d_load[i, _OWN_L] = static, own_short, own_long
    load = running + waiting
    totals[_LOAD_SUM] += load - d_load[i, _LOAD]
    d_load[i, _LOAD] = load
    d_state[i, _FREE] = -1.0 if waiting > 0 else free
    d_state[i, _WAIT], d_state[i, _L_END], d_state[i, _L_SPT] = admit_wait, local_end, local_inv
    d_state[i, _L_MAX], d_state[i, _C_END], d_state[i, _C_SPT] = local_max, colo_end, colo_inv
    d_state[i, _PENALTY], d_state[i, _ITL] = penalty, itl
    d_state[i, _K_SHORT] = static + min(own_short, totals[_POOLED_S])
    d_state[i, _K_LONG] = static + min(own_long, totals[_POOLED_L])


@compiled
def derive_all(
    t: float, d_load: FloatArray, d_state: FloatArray, colo: IntArray, p_state: FloatArray,
    totals: FloatArray, itl_slo_s: float, mean_output: float, ns: float, nl: float,
) -> None:  # fmt: skip
    """Every decode row derived (:func:`derive_row`) at ``t``, and the load total summed afresh
    (a build, or a carry's new peers and pool; ``totals``' pooled bounds must be current)."""
    totals[_LOAD_SUM] = 0.0
    for i in range(d_load.shape[0]):
        d_load[i, _LOAD] = 0.0
        derive_row(i, t, d_load, d_state, colo, p_state, totals, itl_slo_s, mean_output, ns, nl)


@compiled
def pooled_bounds(pool_state: FloatArray, t: float, ns: float, nl: float) -> tuple[float, float]:
    """The cheapest pooled prefill of a short (``ns``) and a long (``nl``) prompt at ``t``: the
    lower bound that pruning uses for every D."""
    short, long = math.inf, math.inf
    for k in range(pool_state.shape[0]):
        wait = pool_state[k, _P_END] - t
        q = wait if wait > 0.0 else 0.0
        short = min(short, q + ns * pool_state[k, _P_SPT])
        long = min(long, q + nl * pool_state[k, _P_SPT])
    return short, long


@compiled
def apply_change(
    i: int, j: int, seqs: float, kv: float, prefill: float, t: float, d_load: FloatArray,
    d_state: FloatArray, colo: IntArray, colo_ptr: IntArray, colo_rows: IntArray,
    p_state: FloatArray, p_pool: IntArray, pool_state: FloatArray, totals: FloatArray,
    itl_slo_s: float, mean_output: float, ns: float, nl: float,
) -> None:  # fmt: skip
    """One ledger change at ``t`` to decode row ``i`` and prefill row ``j`` (-1: the daemon is
    not one): ``seqs`` sequences and ``kv`` KV tokens on D, ``prefill`` prompt tokens on its
    own queue and on P's. The rows that read them are derived again. ``colo_rows[colo_ptr[j]:
    colo_ptr[j + 1]]``: the decode rows whose co-located peer is ``j``; ``p_pool[j]``: its
    place in the pool (-1: none)."""
    if i >= 0:
        d_load[i, _RUN] += seqs
        d_load[i, _FREE_T] -= kv
        if prefill != 0.0:
            # An idle daemon starts on new work now; work taken back leaves the rest.
            end = d_load[i, _LEND]
            if prefill > 0.0 and t > end:
                end = t
            d_load[i, _LEND] = end + prefill * d_load[i, _LINV]
        derive_row(i, t, d_load, d_state, colo, p_state, totals, itl_slo_s, mean_output, ns, nl)
    if j < 0 or prefill == 0.0:
        return
    end = p_state[j, _P_END]
    if prefill > 0.0 and t > end:
        end = t
    end += prefill * p_state[j, _P_SPT]
    p_state[j, _P_END] = end
    k = p_pool[j]
    if k >= 0:
        pool_state[k, _P_END] = end
        # More work only raises the pooled minima, so the bounds stand; less may not.
        if prefill < 0.0:
            short, long = pooled_bounds(pool_state, t, ns, nl)
            if short != totals[_POOLED_S] or long != totals[_POOLED_L]:
                totals[_POOLED_S], totals[_POOLED_L] = short, long
                for r in range(d_load.shape[0]):
                    d_state[r, _K_SHORT] = d_load[r, _STATIC] + min(d_load[r, _OWN_S], short)
                    d_state[r, _K_LONG] = d_load[r, _STATIC] + min(d_load[r, _OWN_L], long)
    for r in colo_rows[colo_ptr[j] : colo_ptr[j + 1]]:
        derive_row(r, t, d_load, d_state, colo, p_state, totals, itl_slo_s, mean_output, ns, nl)


def warm() -> None:
    """Compile (or load from the disk cache) the updates before the first request needs them."""
    d_load = np.ones((1, len(DLoad)))
    d_state = np.zeros((1, len(Row) + len(DState)))
    p_state, pool = np.ones((1, len(PState))), np.ones((1, len(PState)))
    ints = np.zeros(1, np.intp)
    totals = np.zeros(len(Totals))
    derive_all(0.0, d_load, d_state, ints, p_state, totals, 1.0, 1.0, 1.0, 1.0)
    pooled_bounds(pool, 0.0, 1.0, 1.0)  # a build's, from Python
    apply_change(0, 0, 1.0, 1.0, -1.0, 0.0, d_load, d_state, ints, np.array([0, 1], np.intp),
                 ints, p_state, ints, pool, totals, 1.0, 1.0, 1.0, 1.0)  # fmt: skip
