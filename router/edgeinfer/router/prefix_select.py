"""Placement when the router knows which daemons hold the prompt's leading blocks.

The prefix-blind selector (:mod:`edgeinfer.router.selector`) prices a pruned set of decode
daemons against a pool of cheap prefill daemons. With prefix hits the candidates are that same
pruned set plus the daemons holding the prefix (the best holders, those within the load bound),
and the prefill side that pool plus the candidates' co-located peers plus the prefill daemons
holding the prefix. Each pair is priced as :func:`edgeinfer.router.prefix_scoring.price_pairs`
does (the prefill daemon computes only the suffix it lacks, the transfer moves only the blocks
the decode daemon lacks), but only the pairs that can place the request
(:mod:`edgeinfer.router.prefix_pairs`: bounds by RTT, transfer and load first). The load guard
(:func:`~edgeinfer.router.prefix_scoring.under_bound`) keeps a hot prefix from making its
holders a hot spot: a daemon above ``1 + load_eps`` times the mean load is no candidate, and
near-ties are broken by load as elsewhere. Candidates above the bound are left out before
pricing (a prefill daemon there pairs with none; a decode daemon there is priced only when none
within it can place, as ``rank`` falls back), so the choice is the one pricing them all gives.

The prefix index is asked about candidates only (``PrefixHits.lookup``): the
``prefix_lookup_candidates`` best decode daemons by network and static cost (a wider cut than
the priced one, so a conversation's daemon is found while it is not among the very cheapest),
their co-located prefill peers and the prefill pool. None of them holding a block, the request
is placed as without prefix knowledge.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np

from edgeinfer.router.candidate_cut import KEY_LONG, KEY_SHORT, ClientRtt, compiled
from edgeinfer.router.load_arrays import LoadArrays
from edgeinfer.router.load_columns import DLoad, DState, PState, Row
from edgeinfer.router.network import FloatArray, IntArray, NetworkModel
from edgeinfer.router.placement import Placement, PlacementConfig, RequestFeatures
from edgeinfer.router.prefix_pairs import ranked, search
from edgeinfer.router.prefix_scoring import cached_tokens

# Columns as plain ints, constants to the compiler.
_FREE, _WAIT, _L_END = int(Row.FREE_TOKENS), int(Row.ADMIT_WAIT_S), int(Row.LOCAL_END)
_L_SPT, _L_MAX, _PENALTY = int(Row.LOCAL_S_PER_TOKEN), int(Row.LOCAL_MAX_TOKENS), int(Row.PENALTY)
_ITL, _LOAD = int(Row.ITL_S), int(DLoad.LOAD)
_P_END, _P_SPT = int(PState.END), int(PState.S_PER_TOKEN)


def _best(hits: list[tuple[int, float, int]], k: int) -> list[int]:
    """Indices of the ``k`` best holders: most blocks, then the nearest or least queued
    (entries are (blocks, cost, index))."""
    hits.sort(key=lambda h: (-h[0], h[1]))
    return [i for _, _, i in hits[:k]]


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
    k, eps = cfg.decode_candidates, cfg.load_eps
    key = KEY_SHORT if prompt <= cfg.short_prompt_tokens else KEY_LONG
    # The load guard's bounds (prefix_scoring.under_bound) as scalars: only the candidates'
    # loads are compared with them.
    load, p_end = a.load, a.p_end
    d_bound = (1.0 + eps) * (a.load_sum + 1.0) / len(load) + 1.0
    job_s = prompt * a.p_inv_mean
    p_bound = (
        (1.0 + eps) * (queued_s(a.p_state, float(t)) + job_s) / len(a.p) + job_s
        if len(a.p)
        else 0.0
    )
    hits = px.hits
    if px.lookup is not None:
        # The index is asked about the candidates only: the pruned decode daemons of a wider
        # cut, their co-located prefill peers and the prefill pool.
        wide_l = rtt.cheapest(key, max(cfg.prefix_lookup_candidates, k))[0].tolist()
        ask = {a.d[i].url for i in wide_l}
        ask.update(a.p[j].url for j in a.pool_list)
        ask.update(a.p[c].url for i in wide_l if (c := a.colo[i]) >= 0)
        hits = px.lookup(ask)
        pruned = wide_l[:k]  # the wide cut is cheapest first
    else:
        pruned = rtt.cheapest(key, k)[0].tolist()
    if not hits:
        return None
    kh = cfg.prefix_candidates
    # Holders within the bound, the nearest to the client (decode) or the least queued
    # (prefill) first among equal hits: a far holder loses on the network what it saves.
    d_held: list[tuple[int, float, int]] = []
    p_held: list[tuple[int, float, int]] = []
    # And the prompt tokens each caches: from the few holders, not by asking every candidate.
    d_tok: dict[int, int] = {}
    p_tok: dict[int, int] = {}
    d_of, p_of = a.d_of, a.p_of
    for url, blocks in hits.items():
        tokens = cached_tokens(prompt, blocks, px.block_size)
        if (i := d_of.get(url)) is not None:
            d_tok[i] = tokens
            if load[i] <= d_bound:
                d_held.append((blocks, rtt(i), i))
        if (j := p_of.get(url)) is not None:
            p_tok[j] = tokens
            q = float(p_end[j]) - t
            if q <= p_bound:  # (a negative queue is an idle daemon: within the bound)
                p_held.append((blocks, q if q > 0.0 else 0.0, j))
    sel_l = sorted(set(pruned).union(_best(d_held, kh)))
    colo = [c for i in sel_l if (c := a.colo[i]) >= 0]
    # Priced: the decode daemons of sel_l within the load bound (those above it only when none
    # within can place), against the pool, the peers and the holders (those above the bound
    # pair with no decode daemon: price_prefix leaves them out before pricing).
    extra = colo + _best(p_held, kh)
    need = prompt + features.max_tokens
    net_s = [rtt(i) for i in sel_l]
    d_cached = [d_tok.get(i, 0) for i in sel_l]
    i64 = np.int64
    found, d_info, pset = price_prefix(
        a.d_state, a.d_load, a.d_pop, a.p_state, a.p_pop, a.pool, np.asarray(extra, dtype=i64),
        np.asarray(list(p_tok), dtype=i64), np.asarray(list(p_tok.values()), dtype=i64),
        np.asarray(sel_l, dtype=i64), np.asarray(net_s), np.asarray(d_cached, dtype=i64),
        a.geo.rtt, float(t), float(need), int(prompt), float(d_bound), float(p_bound),
        int(a.kv_bytes_per_token), int(a.chunk_tokens), float(cfg.work_weight),
        float(net.inter_pop_bytes_per_s), float(net.intra_pop_bytes_per_s),
        float(cfg.near_tie_s), int(limit),
    )  # fmt: skip
    info = d_info.tolist()
    chosen = ranked(found.tolist(), prompt, d_cached, [r[_I_LOAD] for r in info], cfg.near_tie_s,
                    rng, limit, _recent_of(a, sel_l, t))  # fmt: skip
    out = []
    p_rows = pset.tolist()
    for ch in chosen:
        d = a.d[sel_l[ch.d]]
        prefill = a.p[p_rows[ch.prefill]] if ch.prefill >= 0 else None
        if prefill is not None and prefill.url == d.url:
            prefill = None  # a `both` daemon chosen as its own prefill peer is local prefill
        admit, itl = info[ch.d][_I_ADMIT], info[ch.d][_I_ITL]
        terms = {
            "net_s": net_s[ch.d], "admission_s": admit, "prefill_queue_s": ch.queue_s,
            "prefill_compute_s": ch.compute_s, "kv_s": ch.kv_s, "itl_s": itl,
        }  # fmt: skip
        ttft = (
            terms["net_s"] + terms["admission_s"] + terms["prefill_queue_s"]
            + terms["prefill_compute_s"] + terms["kv_s"]
        )  # fmt: skip
        computed = ch.computed_tokens
        out.append(Placement(
            prefill, d, ttft, itl, itl <= cfg.itl_slo_s, terms,
            prefill_cached=prompt - computed, decode_cached=d_cached[ch.d],
            computed_tokens=computed,
        ))  # fmt: skip
    return out


def _recent_of(a: LoadArrays, d_list: list[int], t: float) -> Callable[[int], float] | None:
    """Candidate k's recent placements by this router (rank's tie-break; asked for ties only)."""
    ledger = a.pending
    if ledger is None:
        return None
    return lambda k: ledger.recent(a.d[d_list[k]].url, t)


# price_prefix's d_info columns, per decode candidate.
_I_ADMIT, _I_ITL, _I_LOAD = range(3)


@compiled
def price_prefix(
    d_state: FloatArray, d_load: FloatArray, d_pop: IntArray, p_state: FloatArray,
    p_pop: IntArray, pool: IntArray, extra: IntArray, held: IntArray, held_tokens: IntArray,
    rows: IntArray, net_s: FloatArray, d_cached: IntArray, rtt_s: FloatArray, t: float,
    need: float, prompt: int, d_bound: float, p_bound: float, kvb: int, chunk: int, w: float,
    far_bps: float, near_bps: float, near_tie_s: float, limit: int,
) -> tuple[FloatArray, FloatArray, IntArray]:  # fmt: skip
    """Decode rows ``rows`` (their client RTTs ``net_s``, prompt tokens cached ``d_cached``)
    priced against the prefill pool and ``extra`` rows (``held`` rows cache ``held_tokens``),
    in one pass: prefix_pairs.search's rows (P as a position in ``pset``), per decode row
    ``d_info`` (_I_ADMIT, _I_ITL, _I_LOAD), and ``pset``."""
    pset, p_queue, p_spt, p_pop_c, p_cached = _prefill_side(
        p_state, p_pop, pool, extra, t, p_bound, held, held_tokens
    )
    n = rows.shape[0]
    base, lq, spt = np.empty(n, np.float64), np.empty(n, np.float64), np.empty(n, np.float64)
    local_ok, ok, pop = np.empty(n, np.bool_), np.empty(n, np.bool_), np.empty(n, np.int64)
    info = np.empty((n, 3), np.float64)
    for m in range(n):
        i = rows[m]
        admit = 0.0 if d_state[i, _FREE] >= need else d_state[i, _WAIT]
        base[m] = net_s[m] + admit + d_state[i, _PENALTY]
        end = d_state[i, _L_END]
        lq[m] = end - t if end > t else 0.0
        spt[m] = d_state[i, _L_SPT]
        local_ok[m] = prompt - d_cached[m] <= d_state[i, _L_MAX]
        load = d_load[i, _LOAD]
        ok[m] = load <= d_bound
        pop[m] = d_pop[i]
        info[m, _I_ADMIT], info[m, _I_ITL], info[m, _I_LOAD] = admit, d_state[i, _ITL], load
    found = search(prompt, kvb, chunk, w, base, d_cached, lq, spt, local_ok, ok, pop, p_cached,
                   p_queue, p_spt, np.ones(pset.shape[0], np.bool_), p_pop_c, rtt_s, far_bps,
                   near_bps, near_tie_s, limit)  # fmt: skip
    return found, info, pset


@compiled
def queued_s(p_state: FloatArray, t: float) -> float:
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
    per token, PoP and the prompt tokens it caches (``held`` rows hold ``held_tokens``)."""
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
    for h in range(held.shape[0]):  # a few holders
        for k in range(m):
            if rows[k] == held[h]:
                cached[k] = held_tokens[h]
    return rows, queue, spt, pop, cached


def warm() -> None:
    """Compile (or load from the disk cache) the pricing pass."""
    one, none = np.zeros(1, np.int64), np.zeros(0, np.int64)
    queued_s(np.zeros((1, len(PState))), 0.0)
    # Each scalar of the type select_with_prefix casts it to: another type is another compile.
    price_prefix(np.zeros((1, len(DState) + len(Row))), np.zeros((1, len(DLoad))), one,
                 np.zeros((1, len(PState))), one, one, none, none, none, one, np.zeros(1), one,
                 np.zeros((1, 1)), 0.0, 1.0, 1, 1.0, 1.0, 1, 1, 1.0, 1.0, 1.0, 0.0,
                 1)  # fmt: skip
