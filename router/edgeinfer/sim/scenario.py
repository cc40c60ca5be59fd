"""Named scenarios: the pieces ``edgectl sim``, ``edgectl plan`` and the report share.

A scenario is a workload spec, a region mix, a topology and a policy. Equal GPUs across
policies: every PoP keeps its GPU count; ``split`` policies get the PoP's prefill:decode split,
``both`` policies the same number of colocated GPUs (see ``policies.POLICY_TOPOLOGY``).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from edgeinfer.router.selector import PlacementConfig
from edgeinfer.sim import SimError
from edgeinfer.sim.metrics import Slo
from edgeinfer.sim.policies import POLICY_TOPOLOGY, PREFIX_TRACE_POLICIES, make_policy
from edgeinfer.sim.profile import EngineProfile
from edgeinfer.sim.simulator import SimConfig, SimResult, simulate
from edgeinfer.sim.topology import Split, Topology
from edgeinfer.sim.workload import (
    Workload,
    azure_trace,
    compress,
    mooncake_trace,
    scale,
    spread,
    synthetic,
)

REGION_MIXES: dict[str, dict[str, float]] = {
    # Shares of demand at equal local time; the diurnal curve moves them over the day.
    "world": {"na": 0.3, "eu": 0.25, "as": 0.3, "sa": 0.07, "oc": 0.04, "af": 0.04},
    "three-continents": {"na": 0.35, "eu": 0.3, "as": 0.35},
}
POLICIES = tuple(p for p in POLICY_TOPOLOGY if p not in PREFIX_TRACE_POLICIES)


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    """``kind``: ``azure-code``, ``azure-conv``, ``chat``, ``rag`` or ``chat+rag:F`` (F of the
    requests RAG); ``rate``: requests/s (synthetic) or x the trace's own rate (Azure). With
    ``trace`` (a Mooncake-format JSONL file) ``kind`` is ignored and ``rate`` compresses the
    trace's time; its requests are not thinned (see ``workload``)."""

    kind: str
    rate: float
    duration_s: float
    regions: str = "three-continents"
    hotspot: tuple[str, float] | None = None
    start_utc_h: float = 14.0
    day_s: float = 86_400.0
    seed: int = 0
    trace: Path | None = None

    def build(self) -> Workload:
        if self.regions not in REGION_MIXES:
            raise SimError(f"unknown region mix {self.regions!r}; known: {list(REGION_MIXES)}")
        if self.trace is not None:
            lengths = compress(mooncake_trace(self.trace), self.rate, self.duration_s)
            return spread(lengths, REGION_MIXES[self.regions], self.seed + 1, self.hotspot,
                          self.start_utc_h, self.day_s, thin=False)  # fmt: skip
        if self.kind in ("azure-code", "azure-conv"):
            base = azure_trace(self.kind.removeprefix("azure-"))
            lengths = scale(base, self.rate, self.duration_s, self.seed)
        else:
            m = re.fullmatch(r"(chat|rag)(?:\+rag:([0-9.]+))?", self.kind)
            if m is None:
                raise SimError(f"unknown workload {self.kind!r}")
            share = float(m.group(2)) if m.group(2) else 0.0
            lengths = synthetic(m.group(1), self.rate, self.duration_s, self.seed, share)
        return spread(lengths, REGION_MIXES[self.regions], self.seed + 1, self.hotspot,
                      self.start_utc_h, self.day_s)  # fmt: skip


def placement_config(prof: EngineProfile, slo: Slo) -> PlacementConfig:
    """The router's placement settings for this deployment: its ITL SLO (the KV size is the
    daemons' own, in their heartbeats; ``prof`` sets it there)."""
    return PlacementConfig(itl_slo_s=slo.itl_s)


def topology_for(policy: str, topo: Topology) -> Topology:
    if POLICY_TOPOLOGY.get(policy) == "both":
        return topo.with_splits([Split(0, 0, p.split.gpus) for p in topo.pops])
    return topo


def run(
    policy: str,
    topo: Topology,
    work: Workload,
    prof: EngineProfile,
    cfg: SimConfig,
    slo: Slo,
) -> SimResult:
    if policy not in POLICY_TOPOLOGY:
        raise SimError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    pol = make_policy(policy, cfg.net, placement_config(prof, slo), cfg.seed)
    return simulate(topology_for(policy, topo), work, pol, prof, cfg)


def parse_split(text: str) -> Split:
    """``3P:5D`` or ``2P:5D:1B`` (prefill, decode, both GPUs)."""
    m = re.fullmatch(r"(\d+)P:(\d+)D(?::(\d+)B)?", text.strip(), flags=re.IGNORECASE)
    if m is None:
        raise SimError(f"split {text!r} is not like 1P:3D or 1P:2D:1B")
    return Split(int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))


def parse_hotspot(text: str | None) -> tuple[str, float] | None:
    """``metro:share``, e.g. ``mumbai:0.3``."""
    if not text:
        return None
    metro, _, share = text.partition(":")
    try:
        return metro, float(share)
    except ValueError as e:
        raise SimError(f"hot-spot {text!r} is not like mumbai:0.3") from e
