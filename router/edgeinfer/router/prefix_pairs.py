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

What is left (~5 D, ~10 pairs) is priced in plain Python with price_pairs' expressions in its
order of operations, so scores are equal to the last bit and the choice (ties and the random
draws among near-ties included) is the one pricing every pair gives: ``tests/test_prefix_pairs.py``
checks both on random candidates. When nothing prunes (every pair a tie, e.g. idle identical
daemons) the loop prices every pair at ~0.25 us each; candidate sets above ``SCALAR_MAX_PAIRS``
(an operator's larger ``decode_candidates`` or ``prefill_pool``) take the numpy pass, whose cost
is flat.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Callable
from operator import itemgetter
from typing import NamedTuple

import numpy as np

from edgeinfer.router.network import FloatArray, NetworkModel
from edgeinfer.router.prefix_scoring import price_pairs, rank

# Measured (bench host, loaded): 200 pairs 42 us here vs 72 us numpy; with nothing pruned 512
# pairs 142 us vs 78 us. Above this the worst case would cost more than twice the numpy pass.
SCALAR_MAX_PAIRS = 512
# Bounds are compared with this slack (seconds): the bound and the price round differently, and a
# pair pruned by rounding would change the choice.
_SLACK_S = 1e-6
_INF = math.inf


class Candidates(NamedTuple):
    """A request's candidates as plain lists, one entry per D (``d_*``, ``local_*``) and per P
    (``p_*``): price_pairs' arguments, with each daemon's PoP for the RTT between them."""

    prompt: int
    kv_bytes_per_token: int
    chunk_tokens: int
    work_weight: float
    d_base_s: list[float]
    d_cached: list[int]
    local_queue_s: list[float]
    local_s_per_token: list[float]
    local_ok: list[bool]
    d_load: list[float]
    d_ok: list[bool]  # within the load guard's bound
    d_pop: list[int]
    p_cached: list[int]
    p_queue_s: list[float]
    p_s_per_token: list[float]
    p_ok: list[bool]
    p_pop: list[int]
    rtt_s: FloatArray  # [PoP, PoP] round trip, 0 within one
    # Whether every RTT between two PoPs is > 0 (so a pair is "far", price_pairs' rtt > 0, iff
    # its PoPs differ: the scalar path's bounds rely on it). NetworkModel.fixed_rtt_ms > 0.
    apart: bool = True
    # This router's recent placements on D (by index into d_*): rank's tie-break at equal loads.
    d_recent: Callable[[int], float] | None = None


class PairChoice(NamedTuple):
    """One decode daemon's best pair (indices into the candidates' lists; ``prefill`` -1: D
    prefills itself) and price_pairs' terms for it."""

    d: int
    prefill: int
    ttft_s: float
    score_s: float
    queue_s: float
    compute_s: float
    kv_s: float
    computed_tokens: int


def choose(
    c: Candidates, net: NetworkModel, near_tie_s: float, rng: random.Random, limit: int
) -> list[PairChoice]:
    """The best pairs, one per D, best first, at most ``limit`` (as :func:`choose_vector`)."""
    if not c.apart or len(c.d_base_s) * len(c.p_queue_s) > SCALAR_MAX_PAIRS:
        return choose_vector(c, net, near_tie_s, rng, limit)
    return choose_scalar(c, net, near_tie_s, rng, limit)


def choose_vector(
    c: Candidates, net: NetworkModel, near_tie_s: float, rng: random.Random, limit: int
) -> list[PairChoice]:
    """Every pair priced (:func:`price_pairs`), ranked among the D within the load bound (or, if
    none of them can place, among all)."""
    d_cached = np.asarray(c.d_cached, dtype=np.int64)
    d_pop, p_pop = np.asarray(c.d_pop, dtype=np.intp), np.asarray(c.p_pop, dtype=np.intp)
    prices = price_pairs(
        net, c.prompt, c.kv_bytes_per_token, c.chunk_tokens,
        np.asarray(c.d_base_s, dtype=np.float64), d_cached,
        np.asarray(c.local_queue_s, dtype=np.float64),
        np.asarray(c.local_s_per_token, dtype=np.float64), np.asarray(c.local_ok, dtype=bool),
        np.asarray(c.p_cached, dtype=np.int64), np.asarray(c.p_queue_s, dtype=np.float64),
        np.asarray(c.p_s_per_token, dtype=np.float64), np.asarray(c.p_ok, dtype=bool),
        c.rtt_s[d_pop][:, p_pop], c.work_weight,
    )  # fmt: skip
    # What a placement on each D reuses: the prefill not computed, and the pages D need not
    # receive (a D prefilling its own cached prefix reuses it twice over).
    saved = c.prompt - prices.computed_tokens + d_cached
    load = np.asarray(c.d_load, dtype=np.float64)
    order = rank(prices.score_s, load, np.asarray(c.d_ok, dtype=bool), near_tie_s, rng, limit,
                 saved, c.d_recent)  # fmt: skip
    if not order:  # every candidate above the bound: the least bad of them all the same
        allowed = np.ones(len(load), dtype=bool)
        order = rank(prices.score_s, load, allowed, near_tie_s, rng, limit, saved, c.d_recent)
    p = prices
    out = []
    for j in order:
        out.append(PairChoice(
            j, int(p.prefill[j]), float(p.ttft_s[j]), float(p.score_s[j]), float(p.queue_s[j]),
            float(p.compute_s[j]), float(p.kv_s[j]), int(p.computed_tokens[j]),
        ))  # fmt: skip
    return out


def choose_scalar(
    c: Candidates, net: NetworkModel, near_tie_s: float, rng: random.Random, limit: int
) -> list[PairChoice]:
    """:func:`choose_vector`'s answer, pricing only the pairs the bounds (module doc) keep."""
    # P cheapest first by the bound of any pair with it: queue + compute + work (no transfer).
    w, prompt = c.work_weight, c.prompt
    ps = []
    for j, ok, cached, spt, queue, pop in zip(
        range(len(c.p_ok)), c.p_ok, c.p_cached, c.p_s_per_token, c.p_queue_s, c.p_pop
    ):
        if ok:
            tokens = prompt - cached
            compute = tokens * spt
            ps.append((queue + compute + w * compute, j, queue, compute, tokens, pop))
    ps.sort()
    got = _search(c, net, ps, c.d_ok, near_tie_s, limit)
    if not got:  # as rank's fallback: no D within the bound can place, so all are ranked
        got = _search(c, net, ps, [True] * len(c.d_ok), near_tie_s, limit)
    if not got:
        return []
    got.sort()  # by D, as price_pairs lists them: rank's stable sort breaks equal scores so
    ds = [g.d for g in got]
    saved = [prompt - g.computed_tokens + c.d_cached[g.d] for g in got]
    of = c.d_recent
    recent = (lambda k: of(ds[k])) if of is not None else None
    order = rank([g.score_s for g in got], [c.d_load[d] for d in ds], [True] * len(got),
                 near_tie_s, rng, limit, saved, recent)  # fmt: skip
    return [got[j] for j in order]


_P = tuple[float, int, float, float, int, int]  # bound, index, queue, compute, tokens, PoP


def _search(
    c: Candidates, net: NetworkModel, ps: list[_P], allowed: list[bool], near_tie_s: float,
    limit: int,
) -> list[PairChoice]:  # fmt: skip
    """Each allowed D that rank can return, priced exactly (module doc)."""
    w, prompt, kvb, chunk = c.work_weight, c.prompt, c.kv_bytes_per_token, c.chunk_tokens
    far_bps, near_bps = net.inter_pop_bytes_per_s, net.intra_pop_bytes_per_s
    cheapest = ps[0][0] if ps else _INF
    by_pop: dict[int, list[_P]] = {}  # cheapest first, as ps
    for e in ps:
        by_pop.setdefault(e[5], []).append(e)
    ds = []
    for i, ok in enumerate(allowed):
        if not ok:
            continue
        local_tokens = prompt - c.d_cached[i]
        local_compute = local_tokens * c.local_s_per_token[i]
        local = c.local_queue_s[i] + local_compute if c.local_ok[i] else _INF
        local_score = local + w * local_compute
        # price_pairs' transfer terms for D: the blocks it lacks move (NetworkModel.kv_link_s,
        # kv_exposed_s); at least the last chunk's share of them stays exposed.
        moved = float(local_tokens)
        kv_bytes = moved * kvb
        share = chunk / (moved if moved > 1.0 else 1.0)
        if share > 1.0:
            share = 1.0
        far_link, near_link = kv_bytes / far_bps, kv_bytes / near_bps
        far_floor, near_floor = far_link * share, near_link * share
        # The cheapest D could be: P in its PoP (the LAN's share exposed), or any P elsewhere
        # (the far link's share exposed, the RTT on top), or local prefill.
        own_pop = by_pop.get(c.d_pop[i], ())
        low = cheapest + far_floor
        if own_pop and own_pop[0][0] + near_floor < low:
            low = own_pop[0][0] + near_floor
        floor = c.d_base_s[i] + (local_score if local_score < low else low)
        ds.append((floor, i, local, local_score, local_compute, local_tokens, far_link,
                   near_link, share, far_floor, near_floor, own_pop))  # fmt: skip
    ds.sort(key=itemgetter(0))
    scores: list[float] = []  # of the D priced so far, ascending
    out = []
    for d in ds:
        floor, i, local, local_score, local_compute, local_tokens = d[:6]
        far_link, near_link, share, far_floor, near_floor, own_pop = d[6:]
        # What rank can still return: the limit-th best, and the best's near-ties.
        cut = scores[limit - 1] if len(scores) >= limit else _INF
        if scores and scores[0] + near_tie_s > cut:
            cut = scores[0] + near_tie_s
        if floor > cut + _SLACK_S:
            break  # and every D after it
        base = c.d_base_s[i]
        # Pairs priced above lim cannot matter: beyond what rank returns, or above local
        # prefill (ties go local), or above the best pair found.
        lim = cut - base + 2 * _SLACK_S
        if local_score + _SLACK_S < lim:
            lim = local_score + _SLACK_S
        d_pop = c.d_pop[i]
        rtt_row = c.rtt_s[d_pop]
        best_s, best_j, best = _INF, -1, None
        # P in D's own PoP (no RTT), then the others, each cheapest first.
        for near in (True, False):
            for e in own_pop if near else ps:
                lower = e[0]
                if lower + (near_floor if near else far_floor) > lim:
                    break
                if near:
                    rtt, link = 0.0, near_link
                else:
                    if e[5] == d_pop:
                        continue
                    rtt, link = rtt_row.item(e[5]), far_link
                    if lower + rtt + far_floor > lim:
                        continue
                _, j, queue, compute, tokens, _ = e
                hidden, exposed = link - compute, link * share
                kv = (hidden if hidden > exposed else exposed) + rtt
                total = queue + compute + kv
                score = total + w * compute
                if score < best_s or (score == best_s and j < best_j):
                    best_s, best_j, best = score, j, (total, queue, compute, kv, tokens)
                    if score + _SLACK_S < lim:
                        lim = score + _SLACK_S
        if local_score <= best_s or best is None:
            if not local_score < _INF:
                continue  # nothing can prefill for D
            choice = PairChoice(i, -1, base + local, base + local_score, c.local_queue_s[i],
                                local_compute, 0.0, local_tokens)  # fmt: skip
        else:
            total, queue, compute, kv, tokens = best
            choice = PairChoice(i, best_j, base + total, base + best_s, queue, compute, kv,
                                tokens)  # fmt: skip
        if choice.score_s > cut + _SLACK_S:
            continue  # its best lies beyond what rank returns (pairs above were not priced)
        bisect.insort(scores, choice.score_s)
        out.append(choice)
    return out
