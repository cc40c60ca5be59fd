"""Choosing among a request's (prefill, decode) pairs when prefixes are cached: only the pairs
that can place it are priced.

:func:`~edgeinfer.router.prefix_scoring.price_pairs` prices every decode daemon D against every
prefill daemon P in one numpy pass; :func:`~edgeinfer.router.prefix_scoring.rank` then keeps a
few. With the selector's candidates (~9 D, ~19 P at 300 PoPs) that is ~50 numpy calls on tiny
arrays, where numpy's fixed cost per call is the whole cost. Most pairs cannot win, and bounds
show it before they are priced:

- a pair costs at least ``queue(P) + (1 + work_weight) x compute(P)``, plus their RTT, plus the
  share of the transfer that stays exposed however fast P computes (the last chunk's pages, over
  the LAN within a PoP, over the WAN between two): P taken cheapest first, those in D's PoP
  first, stop once that bound passes the best pair found (or D's own prefill);
- a D costs at least its base (client RTT, admission, SLO penalty) plus the cheapest of those
  bounds, so D taken by that floor stop once it passes what :func:`rank` can still return: the
  ``limit``-th best score, or the best plus ``near_tie_s`` (its near-ties);
- daemons above the load guard's bound are no candidates (P: no pair; D: ranked only when no D
  within it can place, as before).
- a D holding more of the prompt than some P can have that P receive the pages instead of
  computing them (:func:`~edgeinfer.router.prefix_scoring.price_pairs_pulling`, the daemons'
  ``kv_pull``): its pairs are priced against every P, unpruned (:func:`_price_pulling`), since
  a pull can shrink what P computes and the P order by bound no longer holds; its floor is P's
  queue and compute of what neither holds. Such D are the holders, a few a request.

What is left (~5 D, ~10 pairs) is priced in one compiled pass (:func:`search`), with
price_pairs' expressions in its order of operations, so scores are equal to the last bit, and
:func:`rank_found` and :func:`draw` order them as :func:`~edgeinfer.router.prefix_scoring.rank`
would all of them: the choice (ties and the random draws among near-ties included) is the one
pricing every pair gives, which ``tests/test_prefix_pairs.py`` checks on random candidates
against price_pairs_pulling and rank. A pair is near (the LAN's rate, no RTT) where the RTT
between its PoPs is 0, as price_pairs has it: D's own PoP, and any PoP at the same place when
``fixed_rtt_ms`` is 0. When nothing prunes (every pair a tie, e.g. idle identical daemons) the
pass prices every pair, a few nanoseconds each.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
from numba import njit

from edgeinfer.router.jit import compiled
from edgeinfer.router.network import FloatArray, IntArray
from edgeinfer.router.prefix_scoring import BoolArray

# Bounds are compared with this slack (seconds): the bound and the price round differently, and a
# pair pruned by rounding would change the choice.
_SLACK_S = 1e-6


def draw(
    order: list[int], ties: list[int], rng: random.Random, limit: int,
    recent: Callable[[int], float] | None,
) -> list[int]:  # fmt: skip
    """:func:`rank`'s last step on :func:`rank_found`'s answer: among the near-ties left, the
    one this router sent the least lately (``recent(j)``), else one at random, goes first."""
    if len(ties) >= 2 and recent is not None:
        shares = [recent(j) for j in ties]
        least = min(shares)
        ties = [j for j, x in zip(ties, shares, strict=True) if x == least]
    if ties:
        first = ties[rng.randrange(len(ties))] if len(ties) >= 2 else ties[0]
        order.remove(first)
        order.insert(0, first)
    return order[:limit]


# search's answer: one row per decode daemon it can return, in D order (as price_pairs lists
# them: rank's stable sort breaks equal scores so). D and P are positions among the candidates
# (P -1: D prefills itself); the rest are price_pairs' terms for the pair.
D, P, TTFT, SCORE, QUEUE, COMPUTE, KV, COMPUTED = range(8)
_FIELDS = 8


@compiled
def search(
    prompt: int, kvb: int, chunk: int, w: float, d_base: FloatArray, d_cached: IntArray,
    local_queue: FloatArray, local_spt: FloatArray, local_ok: BoolArray, d_ok: BoolArray,
    d_pop: IntArray, p_cached: IntArray, p_queue: FloatArray, p_spt: FloatArray,
    p_ok: BoolArray, p_pop: IntArray, rtt_s: FloatArray, far_bps: float, near_bps: float,
    near_tie_s: float, limit: int,
) -> FloatArray:  # fmt: skip
    """The pairs rank can return, each D's best priced exactly (module doc): among the D within
    the load bound, or, if none of them can place, among all (rank's fallback)."""
    # P cheapest first by the bound of any pair with it: queue + compute + work (no transfer).
    # A stable sort: equal bounds keep P's order, as sorting (bound, index) tuples would.
    keep = np.empty(p_ok.shape[0], np.int64)
    n_keep = 0
    for j in range(p_ok.shape[0]):
        if p_ok[j]:
            keep[n_keep] = j
            n_keep += 1
    keep = keep[:n_keep]
    p_bound = np.empty(keep.shape[0], np.float64)
    p_compute = np.empty(keep.shape[0], np.float64)
    p_tokens = np.empty(keep.shape[0], np.int64)
    for m in range(keep.shape[0]):
        j = keep[m]
        p_tokens[m] = prompt - p_cached[j]
        p_compute[m] = p_tokens[m] * p_spt[j]
        p_bound[m] = p_queue[j] + p_compute[m] + w * p_compute[m]
    order = _stable_order(p_bound)
    ps = keep[order]
    ps_bound, ps_compute, ps_tokens = p_bound[order], p_compute[order], p_tokens[order]
    out = _search(prompt, kvb, chunk, w, d_base, d_cached, local_queue, local_spt, local_ok,
                  d_ok, d_pop, p_cached, p_queue, p_spt, p_pop, rtt_s, far_bps, near_bps,
                  near_tie_s, limit, ps, ps_bound, ps_compute, ps_tokens)  # fmt: skip
    if out.shape[0] == 0:
        out = _search(prompt, kvb, chunk, w, d_base, d_cached, local_queue, local_spt,
                      local_ok, np.ones(d_ok.shape[0], np.bool_), d_pop, p_cached, p_queue, p_spt,
                      p_pop, rtt_s, far_bps, near_bps, near_tie_s, limit, ps, ps_bound,
                      ps_compute, ps_tokens)  # fmt: skip
    return out[_stable_order(out[:, D])]


@compiled
def rank_found(
    found: FloatArray, d_cached: IntArray, d_load: FloatArray, prompt: int, near_tie_s: float
) -> tuple[IntArray, IntArray]:
    """:func:`rank` on :func:`search`'s rows (``d_cached``, ``d_load``: per D), all but its
    last step (:func:`draw`): the rows best first, and the near-ties of the best that reuse the
    most and are the least loaded, from which the draw picks the first."""
    m = found.shape[0]
    finite = np.empty(m, np.int64)
    n = 0
    for j in range(m):
        if -np.inf < found[j, SCORE] < np.inf:
            finite[n] = j
            n += 1
    finite = finite[:n]
    order = finite[_stable_order(found[finite, SCORE])]
    if n == 0:
        return order, order
    limit_s = found[order[0], SCORE] + near_tie_s
    ties = np.empty(n, np.int64)
    saved = np.empty(n, np.int64)
    t = 0
    for j in order:
        if found[j, SCORE] <= limit_s:
            ties[t] = j
            # What a placement on D reuses: the prefill not computed, and the pages D need not
            # receive (a D prefilling its own cached prefix reuses it twice over).
            saved[t] = prompt - int(found[j, COMPUTED]) + d_cached[int(found[j, D])]
            t += 1
    most = saved[:t].max()
    kept = 0
    for u in range(t):
        if saved[u] == most:
            ties[kept] = ties[u]
            kept += 1
    if kept >= 2:
        least = np.inf
        for u in range(kept):
            least = min(least, d_load[int(found[ties[u], D])])
        t, kept = kept, 0
        for u in range(t):
            if d_load[int(found[ties[u], D])] == least:
                ties[kept] = ties[u]
                kept += 1
    return order, ties[:kept]


@compiled
def _stable_order(keys: FloatArray) -> IntArray:
    """``np.argsort(keys, kind="stable")`` by insertion: a few dozen keys, where numba's merge
    sort costs seconds to compile."""
    order = np.arange(keys.shape[0])
    for k in range(1, keys.shape[0]):
        at, key = order[k], keys[order[k]]
        m = k
        while m > 0 and keys[order[m - 1]] > key:
            order[m] = order[m - 1]
            m -= 1
        order[m] = at
    return order


@compiled
def _search(
    prompt: int, kvb: int, chunk: int, w: float, d_base: FloatArray, d_cached: IntArray,
    local_queue: FloatArray, local_spt: FloatArray, local_ok: BoolArray, allowed: BoolArray,
    d_pop: IntArray, p_cached: IntArray, p_queue: FloatArray, p_spt: FloatArray,
    p_pop: IntArray, rtt_s: FloatArray, far_bps: float, near_bps: float, near_tie_s: float,
    limit: int, ps: IntArray, ps_bound: FloatArray, ps_compute: FloatArray, ps_tokens: IntArray,
) -> FloatArray:  # fmt: skip
    """Each allowed D that rank can return, priced exactly (module doc), in the order found."""
    inf = np.inf
    n_d, n_ps = d_base.shape[0], ps.shape[0]
    cheapest = ps_bound[0] if n_ps else inf
    # A D holding more than some P can pull (_price_pulling): its pairs are priced apart.
    least_p = prompt
    for m in range(n_ps):
        if p_cached[ps[m]] < least_p:
            least_p = p_cached[ps[m]]
    # Per D: its floor and price_pairs' terms for it (the transfer: the blocks D lacks move,
    # at least the last chunk's share of them stays exposed).
    floor = np.empty(n_d, np.float64)
    local, local_score = np.empty(n_d, np.float64), np.empty(n_d, np.float64)
    local_compute, share = np.empty(n_d, np.float64), np.empty(n_d, np.float64)
    far_link, near_link = np.empty(n_d, np.float64), np.empty(n_d, np.float64)
    own_first = np.full(n_d, -1, np.int64)  # the cheapest near P (RTT 0), a position in ps
    rows = np.empty(n_d, np.int64)
    n = 0
    for i in range(n_d):
        if not allowed[i]:
            continue
        local_tokens = prompt - d_cached[i]
        lc = local_tokens * local_spt[i]
        lq = local_queue[i] + lc if local_ok[i] else inf
        ls = lq + w * lc
        moved = float(local_tokens)
        kv_bytes = moved * kvb
        sh = chunk / (moved if moved > 1.0 else 1.0)
        if sh > 1.0:
            sh = 1.0
        fl, nl = kv_bytes / far_bps, kv_bytes / near_bps
        own = -1
        for m in range(n_ps):
            if not rtt_s[d_pop[i], p_pop[ps[m]]] > 0.0:
                own = m
                break
        # The cheapest D could be: P near it (the LAN's share exposed), or any P elsewhere
        # (the far link's share exposed, the RTT on top), or local prefill. A D that can pull:
        # P computes at least what neither holds (the pull's time aside), over either link.
        if d_cached[i] > least_p:
            low = _pull_floor(prompt, w, d_cached[i], p_cached, p_queue, p_spt, ps)
            low += (nl if nl < fl else fl) * sh
        else:
            low = cheapest + fl * sh
            if own >= 0 and ps_bound[own] + nl * sh < low:
                low = ps_bound[own] + nl * sh
        floor[i] = d_base[i] + (ls if ls < low else low)
        local[i], local_score[i], local_compute[i], share[i] = lq, ls, lc, sh
        far_link[i], near_link[i], own_first[i] = fl, nl, own
        rows[n] = i
        n += 1
    rows = rows[:n]
    by_floor = rows[_stable_order(floor[rows])]
    scores = np.empty(n, np.float64)  # of the D priced so far, ascending
    out = np.empty((n, _FIELDS), np.float64)
    n_scores = 0
    for i in by_floor:
        # What rank can still return: the limit-th best, and the best's near-ties.
        cut = scores[limit - 1] if n_scores >= limit else inf
        if n_scores and scores[0] + near_tie_s > cut:
            cut = scores[0] + near_tie_s
        if floor[i] > cut + _SLACK_S:
            break  # and every D after it
        base = d_base[i]
        # Pairs priced above lim cannot matter: beyond what rank returns, or above local
        # prefill (ties go local), or above the best pair found.
        lim = cut - base + 2 * _SLACK_S
        if local_score[i] + _SLACK_S < lim:
            lim = local_score[i] + _SLACK_S
        dp = d_pop[i]
        far_floor, near_floor = far_link[i] * share[i], near_link[i] * share[i]
        best_s, best_j = inf, -1
        best_total = best_queue = best_compute = best_kv = 0.0
        best_tokens = 0
        pulling = d_cached[i] > least_p
        if pulling:
            best_s, best_j, best_total, best_queue, best_compute, best_kv, best_tokens = (
                _price_pulling(prompt, kvb, w, d_cached[i], dp, far_link[i], near_link[i],
                               share[i], p_cached, p_queue, p_spt, p_pop, rtt_s, far_bps,
                               near_bps, ps)
            )  # fmt: skip
        # The near P (no RTT), then the others, each cheapest first (a D that can pull: above).
        for k in range(0 if pulling else 2):
            near = k == 0
            start = own_first[i] if near else 0
            if start < 0:
                continue
            for m in range(start, n_ps):
                j = ps[m]
                lower = ps_bound[m]
                rtt = rtt_s[dp, p_pop[j]]
                if near and rtt > 0.0:
                    continue  # (ps holds every P; the near pass takes those at RTT 0)
                if lower + (near_floor if near else far_floor) > lim:
                    break
                if near:
                    rtt, link = 0.0, near_link[i]
                else:
                    if not rtt > 0.0:
                        continue
                    link = far_link[i]
                    if lower + rtt + far_floor > lim:
                        continue
                queue, compute = p_queue[j], ps_compute[m]
                kv, total, score = _priced(queue, compute, link, share[i], rtt, w)
                if score < best_s or (score == best_s and j < best_j):
                    best_s, best_j = score, j
                    best_total, best_queue, best_compute, best_kv = total, queue, compute, kv
                    best_tokens = ps_tokens[m]
                    if score + _SLACK_S < lim:
                        lim = score + _SLACK_S
        row = out[n_scores]
        if local_score[i] <= best_s or best_j < 0:
            if not local_score[i] < inf:
                continue  # nothing can prefill for D
            row[D], row[P], row[TTFT], row[SCORE] = i, -1, base + local[i], base + local_score[i]
            row[QUEUE], row[COMPUTE], row[KV] = local_queue[i], local_compute[i], 0.0
            row[COMPUTED] = prompt - d_cached[i]
        else:
            row[D], row[P], row[TTFT], row[SCORE] = i, best_j, base + best_total, base + best_s
            row[QUEUE], row[COMPUTE], row[KV] = best_queue, best_compute, best_kv
            row[COMPUTED] = best_tokens
        if row[SCORE] > cut + _SLACK_S:
            continue  # its best lies beyond what rank returns (pairs above were not priced)
        # Insert the score in order (scores before n_scores are sorted).
        k = n_scores
        while k > 0 and scores[k - 1] > row[SCORE]:
            scores[k] = scores[k - 1]
            k -= 1
        scores[k] = row[SCORE]
        n_scores += 1
    return out[:n_scores]


@njit(inline="always")
def _priced(
    queue: float, compute: float, link: float, share: float, rtt: float, w: float
) -> tuple[float, float, float]:
    """One pair, as price_pairs prices it: the transfer's exposed part (behind P's compute but
    its last chunk's share, the RTT on top), the TTFT part and the score."""
    hidden, exposed = link - compute, link * share
    kv = (hidden if hidden > exposed else exposed) + rtt
    total = queue + compute + kv
    return kv, total, total + w * compute


@compiled
def _pull_floor(
    prompt: int, w: float, held: int, p_cached: IntArray, p_queue: FloatArray, p_spt: FloatArray,
    ps: IntArray,
) -> float:  # fmt: skip
    """The least any pair with a D holding ``held`` tokens can cost before its transfer: P's
    queue and compute (weighted) of what neither P nor D holds."""
    low = np.inf
    for m in range(ps.shape[0]):
        j = ps[m]
        spared = p_cached[j] if p_cached[j] > held else held
        compute = (prompt - spared) * p_spt[j]
        bound = p_queue[j] + compute + w * compute
        if bound < low:
            low = bound
    return low


@compiled
def _price_pulling(
    prompt: int, kvb: int, w: float, held: int, dp: int, far_link: float, near_link: float,
    share: float, p_cached: IntArray, p_queue: FloatArray, p_spt: FloatArray, p_pop: IntArray,
    rtt_s: FloatArray, far_bps: float, near_bps: float, ps: IntArray,
) -> tuple[float, int, float, float, float, float, int]:  # fmt: skip
    """A D holding ``held`` prompt tokens (in PoP ``dp``) against every P, each P receiving
    what D holds beyond its own hits where that is cheaper than computing it
    (:func:`edgeinfer.router.kv_pull.price_pull`'s rule and arithmetic), as
    :func:`~edgeinfer.router.prefix_scoring.price_pairs_pulling` prices it: the best (score, P,
    TTFT part, queue with the pull, compute, transfer, computed tokens). Not pruned: the P order
    by bound does not hold once a pull can shrink what P computes, and such D are few (the
    holders)."""
    best_s, best_j = np.inf, -1
    best_total = best_queue = best_compute = best_kv = 0.0
    best_tokens = 0
    for m in range(ps.shape[0]):
        j = ps[m]
        rtt = rtt_s[dp, p_pop[j]]
        near = not rtt > 0.0
        queue, tokens = p_queue[j], prompt - p_cached[j]
        extra = held - p_cached[j]
        if extra > 0:
            pull_s = rtt + extra * kvb / (near_bps if near else far_bps)
            if pull_s < extra * p_spt[j]:
                queue, tokens = queue + pull_s, prompt - (p_cached[j] + extra)
        compute = tokens * p_spt[j]
        link = near_link if near else far_link
        kv, total, score = _priced(queue, compute, link, share, rtt, w)
        if score < best_s or (score == best_s and j < best_j):
            best_s, best_j = score, j
            best_total, best_queue, best_compute, best_kv = total, queue, compute, kv
            best_tokens = tokens
    return best_s, best_j, best_total, best_queue, best_compute, best_kv, best_tokens
