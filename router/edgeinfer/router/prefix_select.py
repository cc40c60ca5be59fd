"""Placement when the router knows which daemons hold the prompt's leading blocks.

The prefix-blind selector (:mod:`edgeinfer.router.selector`) prices a pruned set of decode
daemons against a pool of cheap prefill daemons. With prefix hits the candidates are that same
pruned set plus the daemons holding the prefix (the best holders, those within the load bound),
and the prefill side that pool plus the candidates' co-located peers plus the prefill daemons
holding the prefix. Each pair is priced as
:func:`edgeinfer.router.prefix_scoring.price_pairs_pulling` does (the prefill daemon computes
only the suffix it lacks, after receiving what its decode daemon holds beyond it where that is
cheaper; the transfer moves only the blocks the decode daemon lacks), but only the pairs that
can place the request
(:mod:`edgeinfer.router.prefix_pairs`: bounds by RTT, transfer and load first). The load guard
(:func:`~edgeinfer.router.prefix_scoring.under_bound`) keeps a hot prefix from making its
holders a hot spot: a daemon above ``1 + load_eps`` times the mean load is no candidate, and
near-ties are broken by load as elsewhere. Candidates above the bound are left out before
pricing (a prefill daemon there pairs with none; a decode daemon there is priced only when none
within it can place, as ``rank`` falls back), so the choice is the one pricing them all gives.

After the cut (and the index, below), one compiled call (:func:`place_prefix`) does the rest:
the bounds, the holders, the candidates' rows gathered from the load arrays, the pairs priced
(:func:`edgeinfer.router.prefix_pairs.search`) and ranked; Python keeps the ledger's recent
counts and the random draw among near-ties (:func:`~edgeinfer.router.prefix_pairs.draw`) and
builds the placements. ~15 numpy-sized steps in Python cost ~100 us a decision; the one call
costs ~10.

The prefix index is asked about candidates only (``PrefixHits.lookup``): the
``prefix_lookup_candidates`` best decode daemons by network and static cost (a wider cut than
the priced one, so a conversation's daemon is found while it is not among the very cheapest),
their co-located prefill peers and the prefill pool. None of them holding a block, the request
is placed as without prefix knowledge.
"""

from __future__ import annotations

import random

import numpy as np

from edgeinfer.router.candidate_cut import KEY_LONG, KEY_SHORT, ClientRtt, rtt_of
from edgeinfer.router.jit import compiled
from edgeinfer.router.load_arrays import LoadArrays
from edgeinfer.router.load_columns import DLoad, DState, PState, Row
from edgeinfer.router.network import FloatArray, IntArray, NetworkModel
from edgeinfer.router.placement import Placement, PlacementConfig, RequestFeatures
from edgeinfer.router.prefix_pairs import (
    COMPUTE,
    COMPUTED,
    KV,
    QUEUE,
    D,
    P,
    draw,
    rank_found,
    search,
)
from edgeinfer.router.prefix_scoring import cached_tokens

# Columns as plain ints, constants to the compiler.
_FREE, _WAIT, _L_END = int(Row.FREE_TOKENS), int(Row.ADMIT_WAIT_S), int(Row.LOCAL_END)
_L_SPT, _L_MAX, _PENALTY = int(Row.LOCAL_S_PER_TOKEN), int(Row.LOCAL_MAX_TOKENS), int(Row.PENALTY)
_ITL, _LOAD = int(Row.ITL_S), int(DLoad.LOAD)
_P_END, _P_SPT = int(PState.END), int(PState.S_PER_TOKEN)


def select_with_prefix(
    a: LoadArrays, net: NetworkModel, rtt: ClientRtt, features: RequestFeatures,
    cfg: PlacementConfig, rng: random.Random, limit: int, t: float,
) -> list[Placement] | None:  # fmt: skip
    """Placements best first, one per decode daemon; None when no candidate holds any of the
    prompt's blocks (the prefix-blind path decides)."""
    px = features.prefix
    if px is None:
        return None
    prompt = max(1, features.prompt_tokens)
    k = cfg.decode_candidates
    key = KEY_SHORT if prompt <= cfg.short_prompt_tokens else KEY_LONG
    hits = px.hits
    if px.lookup is not None:
        # The index is asked about the candidates only: the pruned decode daemons of a wider
        # cut, their co-located prefill peers and the prefill pool.
        wide_l = rtt.cheapest(key, max(cfg.prefix_lookup_candidates, k))[0].tolist()
        hits = px.lookup(a.asked(wide_l))
        pruned = wide_l[:k]  # the wide cut is cheapest first
    else:
        pruned = rtt.cheapest(key, k)[0].tolist()
    if not hits:
        return None
    # The holders as rows (-1: not a daemon of that side here), blocks held and the prompt
    # tokens those spare.
    d_of, p_of = a.d_of, a.p_of
    i64 = np.int64
    held_d = np.asarray([d_of.get(url, -1) for url in hits], dtype=i64)
    held_p = np.asarray([p_of.get(url, -1) for url in hits], dtype=i64)
    blocks = list(hits.values())
    tokens = [cached_tokens(prompt, b, px.block_size) for b in blocks]
    x, y, z = rtt.point
    cand, found, order, ties, pset = place_prefix(
        a.d_state, a.d_load, a.d_pop, a.colo_arr, a.p_state, a.p_pop, a.pool, a.geo.rtt,
        x, y, z, float(rtt.scale), float(rtt.fixed), bool(rtt.use_measured),
        np.asarray(pruned, dtype=i64),
        held_d, held_p, np.asarray(blocks, dtype=i64), np.asarray(tokens, dtype=i64),
        int(cfg.prefix_candidates), int(prompt), float(prompt + features.max_tokens), float(t),
        float(a.load_sum), float(cfg.load_eps), float(a.p_inv_mean), int(a.kv_bytes_per_token),
        int(a.chunk_tokens), float(cfg.work_weight), float(net.inter_pop_bytes_per_s),
        float(net.intra_pop_bytes_per_s), float(cfg.near_tie_s), int(limit),
    )  # fmt: skip
    rows, c = found.tolist(), cand.tolist()
    ledger = a.pending
    # rank's tie-break at equal loads: this router's recent placements (asked for ties only).
    recent = (
        (lambda j: ledger.recent(a.d[int(c[int(rows[j][D])][_C_ROW])].url, t))
        if ledger is not None
        else None
    )
    out = []
    p_rows = pset.tolist()
    for j in draw(order.tolist(), ties.tolist(), rng, limit, recent):
        row = rows[j]
        dc = c[int(row[D])]
        d = a.d[int(dc[_C_ROW])]
        prefill = a.p[p_rows[int(row[P])]] if row[P] >= 0 else None
        if prefill is not None and prefill.url == d.url:
            prefill = None  # a `both` daemon chosen as its own prefill peer is local prefill
        itl = dc[_C_ITL]
        terms = {
            "net_s": dc[_C_NET], "admission_s": dc[_C_ADMIT], "prefill_queue_s": row[QUEUE],
            "prefill_compute_s": row[COMPUTE], "kv_s": row[KV], "itl_s": itl,
        }  # fmt: skip
        ttft = (
            terms["net_s"] + terms["admission_s"] + terms["prefill_queue_s"]
            + terms["prefill_compute_s"] + terms["kv_s"]
        )  # fmt: skip
        computed = int(row[COMPUTED])
        out.append(Placement(
            prefill, d, ttft, itl, itl <= cfg.itl_slo_s, terms,
            prefill_cached=prompt - computed, decode_cached=int(dc[_C_CACHED]),
            computed_tokens=computed,
        ))  # fmt: skip
    return out


# place_prefix's cand columns, one row per decode candidate.
_C_ROW, _C_NET, _C_ADMIT, _C_ITL, _C_CACHED = range(5)


@compiled
def place_prefix(
    d_state: FloatArray, d_load: FloatArray, d_pop: IntArray, colo: IntArray, p_state: FloatArray,
    p_pop: IntArray, pool: IntArray, rtt_s: FloatArray, px: float, py: float, pz: float,
    scale: float, fixed: float, use_measured: bool, pruned: IntArray, held_d: IntArray,
    held_p: IntArray, held_blocks: IntArray, held_tokens: IntArray, kh: int, prompt: int,
    need: float,
    t: float, load_sum: float, eps: float, p_inv_mean: float, kvb: int, chunk: int, w: float,
    far_bps: float, near_bps: float, near_tie_s: float, limit: int,
) -> tuple[FloatArray, FloatArray, IntArray, IntArray, IntArray]:  # fmt: skip
    """One prefix placement's candidates, priced and ranked (module doc). The client is
    ClientRtt's (``px``, ``py``, ``pz``, ``scale``, ``fixed``, ``use_measured``); ``pruned``:
    the decode rows of its cut; holder ``h`` holds ``held_blocks[h]`` leading blocks, sparing
    ``held_tokens[h]`` prompt tokens, and is decode row ``held_d[h]`` and prefill row
    ``held_p[h]`` (-1: none). Returns the decode
    candidates (``cand``, _C_* columns), prefix_pairs.search's rows (D: a position in
    ``cand``, P: a position in ``pset``), rank_found's order and ties, and ``pset``."""
    n_d, n_p, n_h = d_state.shape[0], p_state.shape[0], held_blocks.shape[0]
    # The load guard's bounds (prefix_scoring.under_bound) as scalars: only the candidates'
    # loads are compared with them.
    d_bound = (1.0 + eps) * (load_sum + 1.0) / n_d + 1.0
    job_s = prompt * p_inv_mean
    p_bound = (1.0 + eps) * (_queued_s(p_state, t) + job_s) / n_p + job_s if n_p else 0.0
    # Holders within the bound, the most blocks first, then the nearest to the client (decode)
    # or the least queued (prefill): a far holder loses on the network what it saves. The
    # best kh of each side join the candidates.
    d_keys, d_rows = np.empty(n_h, np.float64), np.empty(n_h, np.int64)
    p_keys, p_rows = np.empty(n_h, np.float64), np.empty(n_h, np.int64)
    d_blocks, p_blocks = np.empty(n_h, np.int64), np.empty(n_h, np.int64)
    nd = np_ = 0
    for h in range(n_h):
        i, j = held_d[h], held_p[h]
        if i >= 0 and d_load[i, _LOAD] <= d_bound:
            d_rows[nd], d_blocks[nd] = i, held_blocks[h]
            d_keys[nd] = rtt_of(d_state, i, px, py, pz, scale, fixed, use_measured)
            nd += 1
        if j >= 0:
            q = p_state[j, _P_END] - t
            if q <= p_bound:  # (a negative queue is an idle daemon: within the bound)
                p_rows[np_], p_blocks[np_] = j, held_blocks[h]
                p_keys[np_] = q if q > 0.0 else 0.0
                np_ += 1
    best_d = _best(d_rows[:nd], d_blocks[:nd], d_keys[:nd], kh)
    best_p = _best(p_rows[:np_], p_blocks[:np_], p_keys[:np_], kh)
    # The decode candidates, in row order: the cut and the best holders.
    mark = np.zeros(n_d, np.bool_)
    for i in pruned:
        mark[i] = True
    for i in best_d:
        mark[i] = True
    n = 0
    for i in range(n_d):
        n += mark[i]
    rows = np.empty(n, np.int64)
    m = 0
    for i in range(n_d):
        if mark[i]:
            rows[m] = i
            m += 1
    # The prefill side: the pool, the candidates' co-located peers, the best holders (those
    # above the bound pair with no decode daemon: _prefill_side leaves them out).
    extra = np.empty(n + best_p.shape[0], np.int64)
    e = 0
    for i in rows:
        if colo[i] >= 0:
            extra[e] = colo[i]
            e += 1
    for j in best_p:
        extra[e] = j
        e += 1
    pset, p_queue, p_spt, p_pop_c, p_cached = _prefill_side(
        p_state, p_pop, pool, extra[:e], t, p_bound, held_p, held_tokens
    )
    # Per decode candidate, what price_pairs takes of it. Those above the load bound are
    # priced only when none within it can place (search's fallback, as rank's).
    base, lq, spt = np.empty(n, np.float64), np.empty(n, np.float64), np.empty(n, np.float64)
    local_ok, ok, pop = np.empty(n, np.bool_), np.empty(n, np.bool_), np.empty(n, np.int64)
    d_cached, load = np.zeros(n, np.int64), np.empty(n, np.float64)
    cand = np.empty((n, 5), np.float64)
    for m in range(n):
        i = rows[m]
        for h in range(n_h):
            if held_d[h] == i:
                d_cached[m] = held_tokens[h]
        net = rtt_of(d_state, i, px, py, pz, scale, fixed, use_measured)
        admit = 0.0 if d_state[i, _FREE] >= need else d_state[i, _WAIT]
        base[m] = net + admit + d_state[i, _PENALTY]
        end = d_state[i, _L_END]
        lq[m] = end - t if end > t else 0.0
        spt[m] = d_state[i, _L_SPT]
        local_ok[m] = prompt - d_cached[m] <= d_state[i, _L_MAX]
        load[m] = d_load[i, _LOAD]
        ok[m] = load[m] <= d_bound
        pop[m] = d_pop[i]
        cand[m, _C_ROW], cand[m, _C_NET], cand[m, _C_ADMIT] = i, net, admit
        cand[m, _C_ITL], cand[m, _C_CACHED] = d_state[i, _ITL], d_cached[m]
    found = search(prompt, kvb, chunk, w, base, d_cached, lq, spt, local_ok, ok, pop, p_cached,
                   p_queue, p_spt, np.ones(pset.shape[0], np.bool_), p_pop_c, rtt_s, far_bps,
                   near_bps, near_tie_s, limit)  # fmt: skip
    order, ties = rank_found(found, d_cached, load, prompt, near_tie_s)
    return cand, found, order, ties, pset


@compiled
def _best(rows: IntArray, blocks: IntArray, cost: FloatArray, k: int) -> IntArray:
    """The ``k`` best of ``rows``: most blocks, then the least cost; equal ones in the order
    given (a stable sort)."""
    n = rows.shape[0]
    order = np.arange(n)
    for a in range(1, n):
        at = order[a]
        b = a
        while b > 0 and (
            blocks[order[b - 1]] < blocks[at]
            or (blocks[order[b - 1]] == blocks[at] and cost[order[b - 1]] > cost[at])
        ):
            order[b] = order[b - 1]
            b -= 1
        order[b] = at
    return rows[order[:k]]


@compiled
def _queued_s(p_state: FloatArray, t: float) -> float:
    """Seconds of prefill queued on every prefill row at ``t`` (the load guard's total)."""
    total = 0.0
    for j in range(p_state.shape[0]):
        q = p_state[j, _P_END] - t
        if q > 0.0:
            total += q
    return total


@compiled
def _prefill_side(
    p_state: FloatArray, p_pop: IntArray, pool: IntArray, extra: IntArray, t: float,
    bound: float, held: IntArray, held_tokens: IntArray,
) -> tuple[IntArray, FloatArray, FloatArray, IntArray, IntArray]:  # fmt: skip
    """The prefill rows a request's pairs are priced with: the pool and ``extra`` (peers,
    holders), those whose queue is within ``bound``, in row order; per row its queue, seconds
    per token, PoP and the prompt tokens it caches (``held`` rows hold ``held_tokens``; -1
    entries are no prefill row)."""
    n = p_state.shape[0]
    mark = np.zeros(n, np.bool_)
    for j in pool:
        mark[j] = True
    for j in extra:
        mark[j] = True
    rows = np.empty(n, np.int64)
    queue = np.empty(n, np.float64)
    m = 0
    for j in range(n):
        if mark[j]:
            q = p_state[j, _P_END] - t
            q = q if q > 0.0 else 0.0
            if q <= bound:
                rows[m], queue[m] = j, q
                m += 1
    rows, queue = rows[:m], queue[:m]
    spt, pop, cached = np.empty(m, np.float64), np.empty(m, np.int64), np.zeros(m, np.int64)
    for k in range(m):
        spt[k], pop[k] = p_state[rows[k], _P_SPT], p_pop[rows[k]]
    for h in range(held.shape[0]):  # a few holders (-1 matches no row)
        for k in range(m):
            if rows[k] == held[h]:
                cached[k] = held_tokens[h]
    return rows, queue, spt, pop, cached


def warm() -> None:
    """Compile (or load from the disk cache) the placement pass."""
    one = np.zeros(1, np.int64)
    # Each scalar of the type select_with_prefix casts it to: another type is another compile.
    place_prefix(np.zeros((1, len(DState) + len(Row))), np.zeros((1, len(DLoad))), one, one,
                 np.zeros((1, len(PState))), one, one, np.zeros((1, 1)), 1.0, 0.0, 0.0, 1.0, 0.0,
                 True, one, one, one, one, one, 4, 1, 1.0, 0.0, 0.0, 0.25, 1.0, 1, 1, 1.0, 1.0,
                 1.0, 0.0, 1)  # fmt: skip
