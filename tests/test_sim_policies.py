"""The simulator places with the router's own selector; drains and failures behave."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from edgeinfer.router import selector
from edgeinfer.sim.events import FAILED, Outage, SimConfig
from edgeinfer.sim.metrics import summary
from edgeinfer.sim.scenario import WorkloadSpec, run
from edgeinfer.sim.simulator import SimResult
from edgeinfer.sim.workload import Workload
from sim_helpers import PROFILE, SLO, small_world


def chat(rate: float = 120.0, seconds: float = 30.0) -> Workload:
    return WorkloadSpec("chat+rag:0.3", rate, seconds, hotspot=("london", 0.4)).build()


def test_router_policy_is_the_router_selector(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every placement the simulation makes is the first answer of ``selector.select``: a
    second implementation in the simulator would bypass the spy and fail here."""
    real: Callable[..., Any] = selector.select
    answers: list[tuple[str, str | None]] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        first = out[0] if out else None
        answers.append((first.decode.url, first.prefill.url if first.prefill else None)
                       if first else ("", None))  # fmt: skip
        return out

    monkeypatch.setattr(selector, "select", spy)
    work = chat()
    res = run("router", small_world(), work, PROFILE, SimConfig(), SLO)
    assert len(answers) == len(work)
    urls = [e["url"] for e in res.engines]
    placed = [(urls[d], urls[p] if p >= 0 else None)
              for d, p in zip(res.requests["decode"].tolist(), res.requests["prefill"].tolist())]  # fmt: skip
    # No failures here, so no placement moved to a later answer or fell back to local prefill.
    assert placed == answers
    assert any(p is not None for _, p in placed), "the scenario never used remote prefill"


def pop_of(res: SimResult, column: str) -> np.ndarray:
    pops = np.array([str(e["pop"]) for e in res.engines])
    idx = res.requests[column]
    return np.where(idx >= 0, pops[np.maximum(idx, 0)], "")


def test_drained_pop_receives_nothing() -> None:
    work = chat()
    base = run("router", small_world(), work, PROFILE, SimConfig(), SLO)
    busiest = max(base.received, key=lambda p: base.received[p])
    cfg = SimConfig(outages=(Outage(busiest, 10.0, None, "drain"),))
    for policy in ("router", "nearest", "round-robin"):
        res = run(policy, small_world(), work, PROFILE, cfg, SLO)
        after = work.t > 10.0
        assert (pop_of(res, "decode")[~after] == busiest).any(), policy
        assert not (pop_of(res, "decode")[after] == busiest).any(), policy
        assert not (pop_of(res, "prefill")[after] == busiest).any(), policy
        assert summary(res, SLO)["failed"] == 0


def test_failed_pop_in_flight_requests_are_counted() -> None:
    work = chat(rate=150.0, seconds=40.0)
    base = run("router", small_world(), work, PROFILE, SimConfig(), SLO)
    busiest = max(base.received, key=lambda p: base.received[p])
    cfg = SimConfig(outages=(Outage(busiest, 10.0, 30.0, "fail"),))
    res = run("router", small_world(), work, PROFILE, cfg, SLO)
    failed = int((res.requests["status"] == FAILED).sum())
    assert failed > 0
    assert res.counters["failed_in_flight"] == failed
    # Lost requests were all on the failed PoP's decode engines.
    assert set(pop_of(res, "decode")[res.requests["status"] == FAILED]) == {busiest}
    # After the daemons went stale (3 heartbeats) and before recovery, nothing new goes there.
    window = (work.t > 10.0 + 3 * cfg.heartbeat_interval_s + 0.1) & (work.t < 30.0)
    assert window.any()
    assert not (pop_of(res, "decode")[window] == busiest).any()
    assert summary(res, SLO)["done"] + failed + summary(res, SLO)["rejected"] == len(work)
