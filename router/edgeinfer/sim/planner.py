"""Which prefill:decode split each PoP should run: a search with the simulator as the oracle.

Goodput is not separable per PoP (the router moves work between PoPs, which is the point), so
the search is coordinate descent over groups of PoPs: first the best single split for every
PoP, then, group by group (a region or a metro), the best split for that group with the others
held, repeated while it improves. Each candidate is one simulation with the router's policy on
the same workload and seed, so differences are the split's and not noise's. A tie keeps the
split with more decode GPUs (the cheaper mistake: decode capacity also serves local prefill).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from edgeinfer.sim import SimError
from edgeinfer.sim.metrics import Slo, summary
from edgeinfer.sim.profile import EngineProfile
from edgeinfer.sim.scenario import run
from edgeinfer.sim.simulator import SimConfig
from edgeinfer.sim.topology import Split, Topology
from edgeinfer.sim.workload import Workload


@dataclasses.dataclass(frozen=True)
class Plan:
    workload: str
    gpus_per_pop: int
    uniform: dict[str, float]  # split label -> goodput with that split everywhere
    by_group: dict[str, str]  # group -> recommended split label
    by_pop: dict[str, str]
    goodput_rps: float  # with the recommendation
    baseline_rps: float  # with the best uniform split
    evaluations: int


def candidates(gpus: int, colocated: bool = True) -> list[Split]:
    """Every prefill:decode split of ``gpus`` with at least one decode GPU, and all-colocated."""
    if gpus < 1:
        raise SimError(f"a PoP needs at least one GPU, got {gpus}")
    out = [Split(p, gpus - p) for p in range(gpus)]
    return out + [Split(0, 0, gpus)] if colocated else out


def plan(
    topo: Topology,
    work: Workload,
    prof: EngineProfile,
    cfg: SimConfig,
    slo: Slo,
    gpus: int,
    group_by: str = "region",
    rounds: int = 2,
    progress: Callable[[str], None] | None = None,
) -> Plan:
    if group_by not in ("region", "metro"):
        raise SimError(f"group_by must be region or metro, got {group_by!r}")
    cands = candidates(gpus)
    groups = sorted({getattr(p, group_by) for p in topo.pops})
    evaluations = 0

    def goodput(choice: dict[str, Split]) -> float:
        nonlocal evaluations
        evaluations += 1
        splits = [choice[getattr(p, group_by)] for p in topo.pops]
        res = run("router", topo.with_splits(splits), work, prof, cfg, slo)
        g = float(summary(res, slo)["goodput_rps"])
        if progress:
            progress(f"{' '.join(f'{k}={s.label()}' for k, s in choice.items())}: {g:.1f} rps")
        return g

    def key(g: float, s: Split) -> tuple[float, int]:
        return (round(g, 6), s.decode + s.both)

    uniform = {s.label(): goodput(dict.fromkeys(groups, s)) for s in cands}
    best_uniform = max(cands, key=lambda s: key(uniform[s.label()], s))
    choice = dict.fromkeys(groups, best_uniform)
    best = uniform[best_uniform.label()]
    for _ in range(rounds):
        improved = False
        for g in groups:
            for s in cands:
                if s == choice[g]:
                    continue
                trial = choice | {g: s}
                value = goodput(trial)
                if key(value, s) > key(best, choice[g]) and value > best:
                    choice, best, improved = trial, value, True
        if not improved:
            break
    return Plan(
        workload=work.name,
        gpus_per_pop=gpus,
        uniform=uniform,
        by_group={g: s.label() for g, s in choice.items()},
        by_pop={p.name: choice[getattr(p, group_by)].label() for p in topo.pops},
        goodput_rps=best,
        baseline_rps=uniform[best_uniform.label()],
        evaluations=evaluations,
    )
