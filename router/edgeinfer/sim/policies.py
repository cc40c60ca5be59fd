"""Placement policies: the router's own selector, and the baselines it is measured against.

Every policy sees the same thing the router sees, the registry's snapshot of heartbeats (stale
by up to a heartbeat period), and answers placements best first as ``(decode url, prefill url
or None for local prefill)``; the simulator tries them in order like the proxy does.

``router`` and ``colocated`` call :func:`edgeinfer.router.selector.select` itself (no second
implementation); they differ only in the topology they are given (disaggregated, or every GPU
``both``). The baselines count what they have sent to a daemon since its last heartbeat and add
it to the reported load, which a real balancer in front of its own backends would do: without
it, "least loaded" sends everything to one daemon for a whole heartbeat period and would be a
straw man. The selector gets no such help; it runs exactly as in production.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from edgeinfer.router import selector
from edgeinfer.router.geo import GeoPoint
from edgeinfer.router.network import NetworkModel, unit_vectors
from edgeinfer.router.pop_registry import DaemonView
from edgeinfer.router.selector import PlacementConfig, RequestFeatures
from edgeinfer.sim import SimError

Choice = tuple[str, str | None]
# Which engines each policy is compared on: the GPU split ("split") or all colocated ("both").
POLICY_TOPOLOGY = {
    "router": "split",
    "colocated": "both",
    "nearest": "both",
    "least-loaded": "split",
    "round-robin": "split",
}


class Policy(Protocol):
    name: str

    def place(
        self, views: Sequence[DaemonView], lat: float, lon: float, f: RequestFeatures, here: str
    ) -> list[Choice]: ...


class SelectorPolicy:
    """The production placement: ``select`` with the router's snapshot cache and its retries."""

    def __init__(self, name: str, net: NetworkModel, cfg: PlacementConfig, seed: int) -> None:
        self.name, self.net, self.cfg = name, net, cfg
        self.rng = random.Random(seed)

    def place(
        self, views: Sequence[DaemonView], lat: float, lon: float, f: RequestFeatures, here: str
    ) -> list[Choice]:
        # Through the module, not a copied name: a test swaps in a spy to prove the two agree.
        found = selector.select(views, GeoPoint(lat, lon), f, self.net, self.cfg, self.rng, here, 3)
        return [(p.decode.url, p.prefill.url if p.prefill else None) for p in found]


class _Baseline:
    """Per-snapshot arrays of the available daemons and the loads sent since each heartbeat."""

    def __init__(self, name: str, cfg: PlacementConfig, seed: int) -> None:
        self.name, self.cfg = name, cfg
        self.rng = random.Random(seed)
        self._views: Sequence[DaemonView] | None = None
        self._seen: dict[str, DaemonView] = {}
        self._sent: dict[str, float] = {}

    def _refresh(self, views: Sequence[DaemonView]) -> None:
        if views is self._views:
            return
        self._views = views
        for v in views:
            if self._seen.get(v.url) is not v:  # a new heartbeat: its load includes ours
                self._seen[v.url] = v
                self._sent[v.url] = 0.0
        self.d = [v for v in views if v.available and v.role in ("decode", "both")]
        self.p = [v for v in views if v.available and v.role in ("prefill", "both")]
        self.d_load = np.array([v.running + v.waiting + self._sent[v.url] for v in self.d])
        self.p_load = np.array([v.queued_prefill_tokens + self._sent[v.url] for v in self.p])
        # One pass per side: this runs on every new snapshot (each heartbeat, ~100/s).
        first: dict[str, DaemonView] = {}
        self.pop_d: dict[str, list[int]] = {}
        self.pop_p: dict[str, list[int]] = {}
        for i, v in enumerate(self.d):
            first.setdefault(v.pop, v)
            self.pop_d.setdefault(v.pop, []).append(i)
        for i, v in enumerate(self.p):
            self.pop_p.setdefault(v.pop, []).append(i)
        self.pops = list(first)
        lat_lon = np.array([(v.lat, v.lon) for v in first.values()]).reshape(len(first), 2)
        self.pop_xyz = unit_vectors(lat_lon[:, 0], lat_lon[:, 1])

    def _local(self, d: DaemonView, f: RequestFeatures) -> bool:
        return d.role == "both" or f.prompt_tokens <= self.cfg.local_prefill_max_tokens

    def _take(self, di: int, pi: int | None, f: RequestFeatures) -> list[Choice]:
        d = self.d[di]
        self.d_load[di] += 1
        self._sent[d.url] += 1
        if pi is None:
            return [(d.url, None)]
        p = self.p[pi]
        self.p_load[pi] += f.prompt_tokens
        self._sent[p.url] += f.prompt_tokens
        return [(d.url, p.url)]

    def _least(self, loads: np.ndarray, among: Sequence[int] | None = None) -> int:
        idx = np.asarray(among if among is not None else range(len(loads)))
        best = idx[loads[idx] == loads[idx].min()]
        return int(best[self.rng.randrange(len(best))])


class NearestPolicy(_Baseline):
    """The nearest PoP with capacity, its least-loaded daemon (prefill there too)."""

    def place(
        self, views: Sequence[DaemonView], lat: float, lon: float, f: RequestFeatures, here: str
    ) -> list[Choice]:
        self._refresh(views)
        if not self.d:
            return []
        pop = self.pops[int(np.argmax(self.pop_xyz @ unit_vectors(lat, lon)))]
        di = self._least(self.d_load, self.pop_d[pop])
        if self._local(self.d[di], f) or not self.pop_p.get(pop):
            return self._take(di, None, f)
        return self._take(di, self._least(self.p_load, self.pop_p[pop]), f)


class LeastLoadedPolicy(_Baseline):
    """The least-loaded decode daemon anywhere, the shortest prefill queue anywhere."""

    def place(
        self, views: Sequence[DaemonView], lat: float, lon: float, f: RequestFeatures, here: str
    ) -> list[Choice]:
        self._refresh(views)
        if not self.d:
            return []
        di = self._least(self.d_load)
        if self._local(self.d[di], f) or not self.p:
            return self._take(di, None, f)
        return self._take(di, self._least(self.p_load), f)


class RoundRobinPolicy(_Baseline):
    """Every available decode daemon in turn, every prefill daemon in turn."""

    def __init__(self, name: str, cfg: PlacementConfig, seed: int) -> None:
        super().__init__(name, cfg, seed)
        self._next_d = self._next_p = 0

    def place(
        self, views: Sequence[DaemonView], lat: float, lon: float, f: RequestFeatures, here: str
    ) -> list[Choice]:
        self._refresh(views)
        if not self.d:
            return []
        di = self._next_d % len(self.d)
        self._next_d += 1
        if self._local(self.d[di], f) or not self.p:
            return self._take(di, None, f)
        pi = self._next_p % len(self.p)
        self._next_p += 1
        return self._take(di, pi, f)


def make_policy(name: str, net: NetworkModel, cfg: PlacementConfig, seed: int) -> Policy:
    if name in ("router", "colocated"):
        return SelectorPolicy(name, net, cfg, seed)
    if name == "nearest":
        return NearestPolicy(name, cfg, seed)
    if name == "least-loaded":
        return LeastLoadedPolicy(name, cfg, seed)
    if name == "round-robin":
        return RoundRobinPolicy(name, cfg, seed)
    raise SimError(f"unknown policy {name!r}; known: {', '.join(POLICY_TOPOLOGY)}")
