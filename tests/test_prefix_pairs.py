"""The pruned, compiled pricing of prefix placements (prefix_pairs.choose) gives the numpy
pass's choice (prefix_pairs.choose_vector: prefix_scoring.price_pairs + rank): same decode
daemons in the same order, same prefill peers, scores and terms to the last bit, same random
draws."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from edgeinfer.router.network import NetworkModel
from edgeinfer.router.prefix_pairs import Candidates, choose, choose_vector

NET = NetworkModel()


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
