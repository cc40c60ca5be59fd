"""Queueing sanity: one server with Poisson arrivals behaves like the textbook says.

A ``both`` engine with no per-step fixed cost and no attention term does prefill work exactly
proportional to prompt length, FIFO, without any gain from batching; with output length 1 a
request leaves when its prompt is done. Geometric prompts make the service time (close to)
exponential, so it is an M/M/1 queue: mean time in system 1 / (mu - lambda).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from edgeinfer.sim.metrics import latencies, summary
from edgeinfer.sim.scenario import run
from edgeinfer.sim.topology import Split
from sim_helpers import PROFILE, SLO, one_pop, poisson_at, quiet_config

LINEAR = dataclasses.replace(PROFILE, prefill_fixed_s=0.0, prefill_attention_s=0.0,
                             max_num_batched_tokens=64)  # fmt: skip


@pytest.mark.parametrize("rho", [0.5, 0.7])
def test_single_pop_matches_mm1(rho: float) -> None:
    mean_prompt = 1000
    service = mean_prompt * LINEAR.prefill_token_s  # 40 ms
    lam = rho / service
    work = poisson_at(51.5, -0.1, lam, 10_000, mean_prompt, 1, seed=5)
    cfg = quiet_config(max_seqs=100_000, kv_tokens_per_gpu=10**9)
    res = run("nearest", one_pop(Split(0, 0, 1)), work, LINEAR, cfg, SLO)
    ttft, _, done = latencies(res)
    assert done.all()
    # Client and PoP are one place: the network is the fixed RTT floor.
    sojourn = ttft - cfg.net.fixed_rtt_ms * 1e-3
    expected = 1 / (1 / service - lam)
    assert np.mean(sojourn) == pytest.approx(expected, rel=0.12)


def test_light_load_ttft_is_network_plus_service() -> None:
    work = poisson_at(51.5, -0.1, 0.5, 200, 500, 1, seed=1)
    res = run("nearest", one_pop(Split(0, 0, 1)), work, LINEAR, quiet_config(), SLO)
    ttft, _, _ = latencies(res)
    floor = 2e-3 + work.prompt * LINEAR.prefill_token_s
    # Almost no one waits at this load: the median is the floor.
    assert np.median(ttft - floor) == pytest.approx(0.0, abs=2e-3)
    assert summary(res, SLO)["slo_attainment"] == 1.0
