"""The pruned, compiled pricing of prefix placements (prefix_pairs.search + ranked) gives the
choice of pricing every pair (prefix_scoring.price_pairs_pulling + rank): same decode daemons in
the same order, same prefill peers, scores and terms to the last bit (a prefill daemon's pull
of the pages its decode daemon holds included), same random draws."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
from hypothesis import given, settings
from hypothesis import strategies as st

from edgeinfer.router.network import FloatArray, NetworkModel
from edgeinfer.router.prefix_pairs import draw as draw_first
from edgeinfer.router.prefix_pairs import rank_found, search
from edgeinfer.router.prefix_scoring import price_pairs_pulling, rank

NET = NetworkModel()


class PairChoice(NamedTuple):
    """One decode daemon's best pair (positions among the candidates; ``prefill`` -1: D
    prefills itself) and price_pairs' terms for it: a row of prefix_pairs.search."""

    d: int
    prefill: int
    ttft_s: float
    score_s: float
    queue_s: float
    compute_s: float
    kv_s: float
    computed_tokens: int


class Candidates(NamedTuple):
    """A request's candidates, one entry per D (``d_*``, ``local_*``) and per P (``p_*``):
    price_pairs' arguments, with each daemon's PoP for the RTT between them."""

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
    # This router's recent placements on D (by index into d_*): rank's tie-break at equal loads.
    d_recent: Callable[[int], float] | None = None


def choose(
    c: Candidates, net: NetworkModel, near_tie_s: float, rng: random.Random, limit: int
) -> list[PairChoice]:
    """The pruned path, as prefix_select.place_prefix runs it."""
    f64, i64 = np.float64, np.int64
    d_cached, d_load = _arr(c.d_cached, i64), _arr(c.d_load, f64)
    found = search(
        int(c.prompt), int(c.kv_bytes_per_token), int(c.chunk_tokens), float(c.work_weight),
        _arr(c.d_base_s, f64), d_cached, _arr(c.local_queue_s, f64),
        _arr(c.local_s_per_token, f64), _arr(c.local_ok, np.bool_), _arr(c.d_ok, np.bool_),
        _arr(c.d_pop, i64), _arr(c.p_cached, i64), _arr(c.p_queue_s, f64),
        _arr(c.p_s_per_token, f64), _arr(c.p_ok, np.bool_), _arr(c.p_pop, i64),
        _arr(c.rtt_s, f64), float(net.inter_pop_bytes_per_s), float(net.intra_pop_bytes_per_s),
        float(near_tie_s), int(limit),
    )  # fmt: skip
    order, ties = rank_found(found, d_cached, d_load, int(c.prompt), float(near_tie_s))
    of = c.d_recent
    rows = found.tolist()
    recent = (lambda j: of(int(rows[j][0]))) if of is not None else None
    return [PairChoice(int(d), int(j), ttft, score, queue, compute, kv, int(tokens))
            for d, j, ttft, score, queue, compute, kv, tokens in
            (rows[k] for k in draw_first(order.tolist(), ties.tolist(), rng, limit, recent))]  # fmt: skip


def choose_vector(
    c: Candidates, net: NetworkModel, near_tie_s: float, rng: random.Random, limit: int
) -> list[PairChoice]:
    """The reference: every pair priced (price_pairs_pulling), ranked among the D within the
    load bound (or, if none of them can place, among all)."""
    d_cached = np.asarray(c.d_cached, dtype=np.int64)
    d_pop, p_pop = np.asarray(c.d_pop, dtype=np.intp), np.asarray(c.p_pop, dtype=np.intp)
    prices = price_pairs_pulling(
        net, c.prompt, c.kv_bytes_per_token, c.chunk_tokens,
        np.asarray(c.d_base_s, dtype=np.float64), d_cached,
        np.asarray(c.local_queue_s, dtype=np.float64),
        np.asarray(c.local_s_per_token, dtype=np.float64), np.asarray(c.local_ok, dtype=bool),
        np.asarray(c.p_cached, dtype=np.int64), np.asarray(c.p_queue_s, dtype=np.float64),
        np.asarray(c.p_s_per_token, dtype=np.float64), np.asarray(c.p_ok, dtype=bool),
        c.rtt_s[d_pop][:, p_pop], d_pop, c.work_weight,
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


def _arr(x: Sequence[float] | Sequence[int] | Sequence[bool] | npt.NDArray[Any],
         dtype: type) -> npt.NDArray[Any]:  # fmt: skip
    """``x`` as the contiguous array the compiled search takes (no copy when it is one)."""
    return np.ascontiguousarray(x, dtype=dtype)


@st.composite
def candidates(draw: st.DrawFn) -> tuple[Candidates, float, int, int]:
    n_d, n_p = draw(st.integers(1, 12)), draw(st.integers(0, 30))
    pops = draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**32 - 1))
    r = random.Random(seed)
    prompt = draw(st.sampled_from([1, 7, 200, 800, 3000, 40_000]))

    # Few distinct values, so that exactly equal prices (ties) are common.
    def pick(values: list[float], n: int) -> list[float]:
        return [r.choice(values) for _ in range(n)]

    def cached(n: int) -> list[int]:
        return [r.choice([0, 0, 0, prompt // 2, max(prompt - 1, 0)]) for _ in range(n)]

    # Some PoPs at one place (RTT 0 between them, NetworkModel(fixed_rtt_ms=0)): their pairs
    # are near, as within one PoP.
    same_place = draw(st.booleans())
    geo = np.asarray([[0.0 if a == b or (same_place and a + b == 1) else 0.01 + 0.03 * abs(a - b)
                       for b in range(pops)] for a in range(pops)])  # fmt: skip
    c = Candidates(
        prompt=prompt, kv_bytes_per_token=r.choice([1, 4096, 131_072]),
        chunk_tokens=r.choice([256, 2048]), work_weight=r.choice([0.0, 1.0, 0.5]),
        d_base_s=pick([0.0, 0.01, 0.02, 0.05, 0.3, 1e6], n_d), d_cached=cached(n_d),
        local_queue_s=pick([0.0, 0.0, 0.1, 2.0], n_d),
        local_s_per_token=pick([1e-4, 5e-5, 2e-4], n_d),
        local_ok=[r.random() < 0.5 for _ in range(n_d)], d_load=pick([0.0, 1.0, 3.0, 9.0], n_d),
        d_ok=[r.random() < 0.8 for _ in range(n_d)], d_pop=[r.randrange(pops) for _ in range(n_d)],
        p_cached=cached(n_p), p_queue_s=pick([0.0, 0.0, 0.05, 0.5, 3.0], n_p),
        p_s_per_token=pick([1e-4, 5e-5, 1e-5], n_p), p_ok=[r.random() < 0.85 for _ in range(n_p)],
        p_pop=[r.randrange(pops) for _ in range(n_p)], rtt_s=geo,
    )  # fmt: skip
    if draw(st.booleans()):  # this router's recent placements break ties at equal loads
        shares = pick([0.0, 1.0, 2.5], n_d)
        c = c._replace(d_recent=shares.__getitem__)
    near_tie = draw(st.sampled_from([0.0, 0.005, 0.02, 1.0]))
    return c, near_tie, draw(st.integers(1, 5)), seed


@settings(max_examples=400, deadline=None)
@given(candidates())
def test_the_pruned_pass_chooses_as_pricing_every_pair(case) -> None:
    c, near_tie, limit, seed = case
    rng_v, rng_s = random.Random(seed), random.Random(seed)
    vector = choose_vector(c, NET, near_tie, rng_v, limit)
    pruned = choose(c, NET, near_tie, rng_s, limit)
    assert pruned == vector
    assert rng_s.getstate() == rng_v.getstate()  # the same draws among near-ties


def test_pops_without_rtt_between_them_are_near() -> None:
    rtt = np.zeros((2, 2))  # two PoPs at one place with NetworkModel(fixed_rtt_ms=0)
    c = Candidates(
        prompt=3000, kv_bytes_per_token=131_072, chunk_tokens=2048, work_weight=1.0,
        d_base_s=[0.01, 0.01], d_cached=[0, 0], local_queue_s=[0.0, 0.0],
        local_s_per_token=[1e-4, 1e-4], local_ok=[False, False], d_load=[0.0, 0.0],
        d_ok=[True, True], d_pop=[0, 1], p_cached=[0, 2000],
        p_queue_s=[0.0, 0.0], p_s_per_token=[1e-4, 1e-4], p_ok=[True, True], p_pop=[0, 1],
        rtt_s=rtt,
    )  # fmt: skip
    got = choose(c, NET, 0.02, random.Random(1), 3)
    assert got == choose_vector(c, NET, 0.02, random.Random(1), 3)
    # D in PoP 0 takes P in PoP 1 (its cached 2000 tokens): the pages move at the LAN's rate.
    lan = NET.kv_exposed_s(NET.kv_link_s(3000 * 131_072, same_pop=True), 0.1, 3000, 2048)
    assert got[0].prefill == 1 and got[0].kv_s == lan


def test_large_candidate_sets_get_the_same_answer() -> None:
    r = random.Random(3)
    n_d, n_p = 40, 60
    c = Candidates(
        prompt=5000, kv_bytes_per_token=131_072, chunk_tokens=2048, work_weight=1.0,
        d_base_s=[r.uniform(0, 0.2) for _ in range(n_d)], d_cached=[0] * n_d,
        local_queue_s=[0.0] * n_d, local_s_per_token=[1e-4] * n_d,
        local_ok=[False] * n_d, d_load=[float(r.randrange(5)) for _ in range(n_d)],
        d_ok=[True] * n_d, d_pop=[i % 7 for i in range(n_d)],
        p_cached=[r.choice([0, 2048]) for _ in range(n_p)],
        p_queue_s=[r.uniform(0, 1) for _ in range(n_p)], p_s_per_token=[1e-4] * n_p,
        p_ok=[True] * n_p, p_pop=[i % 7 for i in range(n_p)],
        rtt_s=np.asarray([[0.0 if a == b else 0.02 for b in range(7)] for a in range(7)]),
    )  # fmt: skip
    got = choose(c, NET, 0.02, random.Random(1), 3)
    assert got == choose_vector(c, NET, 0.02, random.Random(1), 3)
    assert len({g.d for g in got}) == 3 and got[1].score_s <= got[2].score_s
