"""Same seed, same simulation; another seed, another sample of the same statistics."""

from __future__ import annotations

import numpy as np
import pytest

from edgeinfer.sim.metrics import latencies, summary
from edgeinfer.sim.scenario import WorkloadSpec, run
from edgeinfer.sim.simulator import SimConfig, SimResult
from sim_helpers import PROFILE, SLO, small_world


def simulate(seed: int) -> SimResult:
    work = WorkloadSpec("chat", 150.0, 40.0, hotspot=("london", 0.3), seed=seed).build()
    return run("router", small_world(), work, PROFILE, SimConfig(seed=seed), SLO)


@pytest.fixture(scope="module")
def runs() -> dict[str, SimResult]:
    return {"a": simulate(1), "a_again": simulate(1), "b": simulate(2)}


def test_same_seed_same_results(runs: dict[str, SimResult]) -> None:
    a, again = runs["a"], runs["a_again"]
    for key, column in a.requests.items():
        np.testing.assert_array_equal(column, again.requests[key], err_msg=key)
    assert a.received == again.received
    assert a.counters == again.counters


def test_other_seed_differs_but_agrees_statistically(runs: dict[str, SimResult]) -> None:
    a, b = runs["a"], runs["b"]
    assert len(a.workload) != len(b.workload) or not np.array_equal(a.workload.t, b.workload.t)
    sa, sb = summary(a, SLO), summary(b, SLO)
    assert sa["offered_rps"] == pytest.approx(sb["offered_rps"], rel=0.05)
    assert sa["slo_attainment"] == pytest.approx(sb["slo_attainment"], abs=0.03)
    for name in ("ttft_s", "itl_s"):
        assert sa[name]["p50"] == pytest.approx(sb[name]["p50"], rel=0.15), name
    ttft_a, ttft_b = latencies(a)[0], latencies(b)[0]
    assert np.nanmean(ttft_a) == pytest.approx(np.nanmean(ttft_b), rel=0.2)
