"""Pull or recompute: the rule (router/kv_pull.py), the simulator's pulls and their accounting,
and the prefix-aware policy pricing pairs with the pull."""

from __future__ import annotations

import numpy as np
import pytest

from edgeinfer.router.kv_pull import price_pull
from edgeinfer.router.network import NetworkModel
from edgeinfer.router.prefix_scoring import price_pairs, price_pairs_pulling
from edgeinfer.sim.metrics import prefix_hits
from edgeinfer.sim.policies import make_policy
from edgeinfer.sim.scenario import placement_config
from edgeinfer.sim.simulator import SimResult, Simulation
from edgeinfer.sim.topology import Split
from edgeinfer.sim.workload import Workload
from sim_helpers import PROFILE, SLO, one_pop, quiet_config

BLOCK = 512
KV = 131_072  # Llama-3-8B's KV bytes per token
S_PER_TOKEN = 4e-5  # ~25k prompt tokens/s


# ---- the rule -------------------------------------------------------------------------------
def test_pull_inside_a_pop_is_cheaper_than_recomputing() -> None:
    net = NetworkModel()
    price = price_pull(net, 8192, 1024, 6144, S_PER_TOKEN, KV, 0.0)
    link = 5120 * KV / net.intra_pop_bytes_per_s
    assert price.pull
    assert price.pulled_tokens == 5120 and price.computed_tokens == 8192 - 6144
    assert price.pull_s == pytest.approx(link)
    assert price.compute_s == pytest.approx(2048 * S_PER_TOKEN)
    assert price.cost_s == pytest.approx(link + 2048 * S_PER_TOKEN)
    assert price.cost_s < (8192 - 1024) * S_PER_TOKEN


def test_pull_between_pops_at_10_gbps_is_dearer() -> None:
    """128 KiB a token at 10 Gb/s is ~105 us a token, over twice the compute: P recomputes."""
    price = price_pull(NetworkModel(), 8192, 0, 6144, S_PER_TOKEN, KV, 0.05)
    assert not price.pull
    assert price.pulled_tokens == 0 and price.pull_s == 0.0
    assert price.computed_tokens == 8192 and price.cost_s == pytest.approx(8192 * S_PER_TOKEN)


def test_round_trip_counts_against_a_short_pull() -> None:
    """Two blocks save 41 ms of compute; a 60 ms round trip costs more even on a fast link."""
    net = NetworkModel(inter_pop_gbps=400.0)
    assert price_pull(net, 8192, 0, 1024, S_PER_TOKEN, KV, 0.0).pull
    assert not price_pull(net, 8192, 0, 1024, S_PER_TOKEN, KV, 0.06).pull


def test_nothing_to_pull_when_p_holds_as_much() -> None:
    price = price_pull(NetworkModel(), 8192, 4096, 2048, S_PER_TOKEN, KV, 0.0)
    assert not price.pull and price.computed_tokens == 4096


def test_pairs_broadcast_as_scalars_do() -> None:
    """[D, 1] against [P]: each pair as its own scalar call."""
    net = NetworkModel()
    rng = np.random.default_rng(0)
    d_cached = rng.integers(0, 8192, 5)
    p_cached = rng.integers(0, 8192, 4)
    rate = rng.uniform(1e-5, 1e-4, 4)
    rtt = np.where(rng.random((5, 4)) < 0.5, 0.0, rng.uniform(0.001, 0.1, (5, 4)))
    grid = price_pull(net, 8192, p_cached, d_cached[:, None], rate, KV, rtt)
    for i in range(5):
        for j in range(4):
            one = price_pull(net, 8192, int(p_cached[j]), int(d_cached[i]), float(rate[j]), KV,
                             float(rtt[i, j]))  # fmt: skip
            assert bool(grid.pull[i, j]) == bool(one.pull)
            assert grid.cost_s[i, j] == pytest.approx(float(one.cost_s))
            assert grid.computed_tokens[i, j] == int(one.computed_tokens)


# ---- the simulator --------------------------------------------------------------------------
def one_request(net: NetworkModel, held_blocks: int) -> SimResult:
    """A 16-block prompt, its decode daemon holding the first ``held_blocks``, its prefill
    daemon none; the prompt is long, so the prefill is remote (1P:1D, one PoP)."""
    keys = tuple(range(16))
    work = Workload(np.array([0.0]), np.array([16 * BLOCK]), np.array([2]), np.array([51.5]),
                    np.array([-0.1]), ["eu"], "one", 0.0, blocks=(keys,))  # fmt: skip
    cfg = quiet_config(net=net)
    policy = make_policy("router-prefix-blind", cfg.net, placement_config(PROFILE, SLO), cfg.seed)
    sim = Simulation(one_pop(Split(1, 1)), work, policy, PROFILE, cfg)
    d = next(e for e in sim.engines if e.role == "decode")
    assert sim.caches is not None
    sim.caches.insert(d.idx, keys[:held_blocks])
    res = sim.run()
    assert res.requests["prefill"][0] >= 0 and res.requests["status"][0] == 1
    return res


def prefill_tokens(res: SimResult) -> float:
    return sum(e["prompt_tokens"] for e in res.engines if e["role"] == "prefill")


def test_prefill_pulls_what_decode_holds_and_counts_it_as_hits() -> None:
    pulled = one_request(NetworkModel(), 12)
    c = pulled.counters
    assert c["prefix_blocks_asked"] == 16
    assert c["prefix_blocks_hit"] == 12 and c["prefix_blocks_pulled"] == 12
    assert c["kv_bytes_pulled"] == 12 * BLOCK * KV
    assert prefill_tokens(pulled) == 4 * BLOCK  # the pulled blocks were not recomputed
    prefix = prefix_hits(pulled)
    assert prefix is not None
    assert prefix["block_hit_rate"] == pytest.approx(12 / 16)
    assert prefix["pulled_block_rate"] == pytest.approx(12 / 16)
    assert prefix["kv_gb_pulled"] == pytest.approx(12 * BLOCK * KV / 1e9)
    assert prefix["fleet_held_rate"] == pytest.approx(12 / 16)  # held somewhere on arrival
    cold = one_request(NetworkModel(), 0)
    assert cold.counters["prefix_blocks_pulled"] == 0 and prefill_tokens(cold) == 16 * BLOCK
    ttft = {k: float(r.requests["first"][0]) for k, r in (("pulled", pulled), ("cold", cold))}
    assert ttft["pulled"] < ttft["cold"]


def test_prefill_recomputes_when_the_link_is_dearer() -> None:
    slow = one_request(NetworkModel(intra_pop_gbps=1.0, inter_pop_gbps=1.0), 12)
    c = slow.counters
    assert c["prefix_blocks_pulled"] == 0 and c["kv_bytes_pulled"] == 0
    assert c["prefix_blocks_hit"] == 0 and prefill_tokens(slow) == 16 * BLOCK


# ---- the prefix-aware policy's pricing ------------------------------------------------------
def test_pair_pricing_values_the_pull() -> None:
    """Two PoPs of one D and one P each; D0 holds most of the prompt, no P holds any: with the
    pull, D0's pair is P0 beside it computing only the rest; D1 is priced as before."""
    net, prompt = NetworkModel(), 8192
    d_cached = np.array([7680, 0], dtype=np.int64)
    p_cached = np.zeros(2, dtype=np.int64)
    rtt = np.array([[0.0, 0.08], [0.08, 0.0]])
    zeros, rate = np.zeros(2), np.full(2, S_PER_TOKEN)
    no_local = np.zeros(2, dtype=bool)
    args = (net, prompt, KV, 2048, zeros, d_cached, zeros, rate, no_local, p_cached,
            np.array([0.0, 0.0]), rate, np.ones(2, dtype=bool), rtt)  # fmt: skip
    plain = price_pairs(*args, 1.0)
    pulling = price_pairs_pulling(*args, np.array([0, 1]), 1.0)
    assert pulling.prefill[0] == 0 and pulling.computed_tokens[0] == prompt - 7680
    assert pulling.ttft_s[0] < plain.ttft_s[0] and pulling.score_s[0] < plain.score_s[0]
    assert plain.computed_tokens[0] == prompt
    for name in ("ttft_s", "score_s", "prefill", "computed_tokens"):
        assert getattr(pulling, name)[1] == getattr(plain, name)[1], name
