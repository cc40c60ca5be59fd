"""Placement policies: the router's own selector, and the baselines it is measured against.

Every policy sees the same thing the router sees, the registry's snapshot of heartbeats (stale
by up to a heartbeat period), and answers placements best first as ``(decode url, prefill url
or None for local prefill)``; the simulator tries them in order like the proxy does.

``router`` and ``colocated`` call :func:`edgeinfer.router.selector.select` itself (no second
implementation); they differ only in the topology they are given (disaggregated, or every GPU
``both``). Every policy records what it sends in the registry's ledger of pending placements
(:mod:`edgeinfer.router.inflight`) and adds it to the reported load, as the proxy does: without
it, "least loaded" sends everything to one daemon for a whole heartbeat period and would be a
straw man. The selector policy records through the proxy's own helper.

On prefix-sharing workloads the simulator hands every policy the prompt's block keys and
(:meth:`Policy.attach`) the fleet's prefix caches; the policies that use them are in
:mod:`edgeinfer.sim.prefix_policies`, the others place as before.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from edgeinfer.router import selector
from edgeinfer.router.geo import GeoPoint
from edgeinfer.router.inflight import PlacementLedger
from edgeinfer.router.network import NetworkModel, unit_vectors
from edgeinfer.router.pop_registry import DaemonView
from edgeinfer.router.selector import Placement, PlacementConfig, RequestFeatures
from edgeinfer.sim import SimError

Choice = tuple[str, str | None]
HitsFn = Callable[[Sequence[int]], dict[str, int]]
# Which engines each policy is compared on: the GPU split ("split") or all colocated ("both").
POLICY_TOPOLOGY = {
    "router": "split",
    "colocated": "both",
    "nearest": "both",
    "least-loaded": "split",
    "round-robin": "split",
    # Prefix-sharing traces (edgeinfer.sim.prefix_policies): the selector as it is today,
    # and the policies that know where prefixes are cached.
    "router-prefix-blind": "split",
    "max-prefix": "split",
    "session-hash": "split",
    "prefix-aware": "split",
}


# Compared on prefix-sharing traces (edgectl sim --trace); the others on any workload.
PREFIX_TRACE_POLICIES = ("router-prefix-blind", "max-prefix", "session-hash", "prefix-aware")


class Policy(Protocol):
    name: str

    def place(
        self, views: Sequence[DaemonView], pending: PlacementLedger, lat: float, lon: float,
        f: RequestFeatures, here: str, now: float, keys: Sequence[int] = (),
    ) -> list[Choice]:  # fmt: skip
        """Placements best first; ``keys``: the prompt's block keys where the workload has them."""
        ...

    def attach(self, hits: HitsFn) -> None:
        """The fleet's prefix caches: block keys -> leading blocks held, per daemon URL."""

    def placed(self, k: int, f: RequestFeatures, pending: PlacementLedger, now: float) -> None:
        """The ``k``-th answer of the last :meth:`place` was sent at ``now``."""


class SelectorPolicy:
    """The production placement: ``select`` with the router's snapshot cache and its retries."""

    def __init__(self, name: str, net: NetworkModel, cfg: PlacementConfig, seed: int) -> None:
        self.name, self.net, self.cfg = name, net, cfg
        self.rng = random.Random(seed)
        self._found: list[Placement] = []

    def attach(self, hits: HitsFn) -> None:
        """Prefix-blind: where prefixes are cached does not enter its placement."""

    def place(
        self, views: Sequence[DaemonView], pending: PlacementLedger, lat: float, lon: float,
        f: RequestFeatures, here: str, now: float, keys: Sequence[int] = (),
    ) -> list[Choice]:  # fmt: skip
        # Through the module, not a copied name: a test swaps in a spy to prove the two agree.
        self._found = selector.select(views, GeoPoint(lat, lon), f, self.net, self.cfg, self.rng,
                                      here, 3, pending=pending, now=now)  # fmt: skip
        return [(p.decode.url, p.prefill.url if p.prefill else None) for p in self._found]

    def placed(self, k: int, f: RequestFeatures, pending: PlacementLedger, now: float) -> None:
        selector.record_placement(pending, self._found[k], f, now)


class _Baseline:
    """Per-snapshot arrays of the available daemons, their reported load plus what is pending
    (the same ledger as the router's; placements in between add to the arrays directly)."""

    def __init__(self, name: str, net: NetworkModel, cfg: PlacementConfig, seed: int) -> None:
        self.name, self.net, self.cfg = name, net, cfg
        self.rng = random.Random(seed)
        self._views: Sequence[DaemonView] | None = None
        self._answer: tuple[DaemonView, DaemonView | None, float, float] | None = None
        self.hits: HitsFn | None = None

    def attach(self, hits: HitsFn) -> None:
        self.hits = hits

    def _refresh(self, views: Sequence[DaemonView], pending: PlacementLedger) -> None:
        if views is self._views:
            return
        self._views = views
        self.d = [v for v in views if v.available and v.role in ("decode", "both")]
        self.p = [v for v in views if v.available and v.role in ("prefill", "both")]
        self.p_of = {v.url: i for i, v in enumerate(self.p)}
        self.d_load = np.array(
            [v.running + v.waiting + pending.totals(v.url)[0] for v in self.d], dtype=np.float64
        )
        self.p_load = np.array(
            [v.queued_prefill_tokens + pending.totals(v.url)[2] for v in self.p], dtype=np.float64
        )
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
        return d.role == "both" or f.prompt_tokens <= d.local_prefill_threshold

    def _take(
        self, di: int, pi: int | None, f: RequestFeatures, lat: float, lon: float
    ) -> list[Choice]:
        d = self.d[di]
        self.d_load[di] += 1
        p = self.p[pi] if pi is not None else None
        if pi is not None:
            self.p_load[pi] += f.prompt_tokens
        elif d.role == "both":
            # The same daemon prefills: its prefill queue grows as well (it is in self.p too).
            k = self.p_of.get(d.url)
            if k is not None:
                self.p_load[k] += f.prompt_tokens
        # Until a heartbeat can show it: the client's RTT to D, and on to P (as the selector).
        to_d = float(self.net.client_rtt_s(GeoPoint(lat, lon), d, d, None))
        to_p = to_d + (self.net.inter_pop_rtt_s(d, p) if p is not None else 0.0)
        self._answer = (d, p, to_d, to_p)
        return [(d.url, p.url if p is not None else None)]

    def placed(self, k: int, f: RequestFeatures, pending: PlacementLedger, now: float) -> None:
        if self._answer is None:
            return
        d, p, to_d, to_p = self._answer
        rate = (p or d).prefill_tokens_per_s or self.cfg.default_prefill_tokens_per_s
        pending.record(now, d.url, p.url if p is not None else None, f.prompt_tokens,
                       f.prompt_tokens + f.max_tokens, to_d, to_p, f.prompt_tokens / rate)  # fmt: skip

    def _least(self, loads: np.ndarray, among: Sequence[int] | None = None) -> int:
        idx = np.asarray(among if among is not None else range(len(loads)))
        best = idx[loads[idx] == loads[idx].min()]
        return int(best[self.rng.randrange(len(best))])


class NearestPolicy(_Baseline):
    """The nearest PoP with capacity, its least-loaded daemon (prefill there too)."""

    def place(
        self, views: Sequence[DaemonView], pending: PlacementLedger, lat: float, lon: float,
        f: RequestFeatures, here: str, now: float, keys: Sequence[int] = (),
    ) -> list[Choice]:  # fmt: skip
        self._refresh(views, pending)
        if not self.d:
            return []
        pop = self.pops[int(np.argmax(self.pop_xyz @ unit_vectors(lat, lon)))]
        di = self._least(self.d_load, self.pop_d[pop])
        if self._local(self.d[di], f) or not self.pop_p.get(pop):
            return self._take(di, None, f, lat, lon)
        return self._take(di, self._least(self.p_load, self.pop_p[pop]), f, lat, lon)


class LeastLoadedPolicy(_Baseline):
    """The least-loaded decode daemon anywhere, the shortest prefill queue anywhere."""

    def place(
        self, views: Sequence[DaemonView], pending: PlacementLedger, lat: float, lon: float,
        f: RequestFeatures, here: str, now: float, keys: Sequence[int] = (),
    ) -> list[Choice]:  # fmt: skip
        self._refresh(views, pending)
        if not self.d:
            return []
        di = self._least(self.d_load)
        if self._local(self.d[di], f) or not self.p:
            return self._take(di, None, f, lat, lon)
        return self._take(di, self._least(self.p_load), f, lat, lon)


class RoundRobinPolicy(_Baseline):
    """Every available decode daemon in turn, every prefill daemon in turn."""

    def __init__(self, name: str, net: NetworkModel, cfg: PlacementConfig, seed: int) -> None:
        super().__init__(name, net, cfg, seed)
        self._next_d = self._next_p = 0

    def place(
        self, views: Sequence[DaemonView], pending: PlacementLedger, lat: float, lon: float,
        f: RequestFeatures, here: str, now: float, keys: Sequence[int] = (),
    ) -> list[Choice]:  # fmt: skip
        self._refresh(views, pending)
        if not self.d:
            return []
        di = self._next_d % len(self.d)
        self._next_d += 1
        if self._local(self.d[di], f) or not self.p:
            return self._take(di, None, f, lat, lon)
        pi = self._next_p % len(self.p)
        self._next_p += 1
        return self._take(di, pi, f, lat, lon)


def make_policy(name: str, net: NetworkModel, cfg: PlacementConfig, seed: int) -> Policy:
    # Here, not at the top: the prefix policies build on this module's baseline.
    from edgeinfer.sim.prefix_policies import PREFIX_POLICIES

    if name in ("router", "colocated", "router-prefix-blind"):
        return SelectorPolicy(name, net, cfg, seed)
    if name in PREFIX_POLICIES:
        return PREFIX_POLICIES[name](name, net, cfg, seed)
    if name == "nearest":
        return NearestPolicy(name, net, cfg, seed)
    if name == "least-loaded":
        return LeastLoadedPolicy(name, net, cfg, seed)
    if name == "round-robin":
        return RoundRobinPolicy(name, net, cfg, seed)
    raise SimError(f"unknown policy {name!r}; known: {', '.join(POLICY_TOPOLOGY)}")
