"""The event loop: requests placed by a policy, served by engines, across a lossy globe.

A request's life: the policy places it against the registry snapshot (a placement on a dead
daemon costs a connect timeout, marks it down and moves to the next, as the proxy does); it
travels half the client RTT to its decode engine and waits for admission there; for remote
prefill its job travels half the P-D RTT, queues and computes on P, and its pages come back
(the part of the transfer not hidden behind compute, plus half the RTT); it decodes at D; its
first token goes back half the client RTT. RTTs and transfer times are the router's own
formulas (:class:`NetworkModel`: fibre floor, link rates, the overlap of pages with compute),
RTTs times log-normal jitter. Daemons report through real heartbeats into a real
``PopRegistry`` every period, and every placement is recorded in its ledger of pending
placements as the proxy does.

With a prefix-sharing workload (block keys per request) every engine has a prefix cache
(:mod:`edgeinfer.sim.prefix_cache`): a prefill computes only what its engine lacks, and only
the blocks the decode engine lacks travel. A prefill engine lacking blocks its decode engine
holds receives them from it instead of computing them where that is cheaper
(:func:`edgeinfer.router.kv_pull.price_pull`, the daemons' rule): a round trip plus the pages
over the pair's link before its prefill starts; they count as hits, and apart as pulled.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import TypedDict

import numpy as np

from edgeinfer.router.kv_pull import price_pull
from edgeinfer.router.network import PopGeometry, unit_vectors
from edgeinfer.router.pop_registry import PopConfig, PopRegistry
from edgeinfer.router.prefix_scoring import cached_tokens
from edgeinfer.router.selector import RequestFeatures
from edgeinfer.shared.heartbeat import Role
from edgeinfer.sim import SimError
from edgeinfer.sim.events import (
    AT_DECODE,
    AT_PREFILL,
    BUCKET,
    DONE,
    HEARTBEAT,
    KV_ARRIVED,
    PENDING,
    POP_DRAIN,
    POP_FAIL,
    POP_RECOVER,
    PULLED,
    REJECTED,
    STATS,
    STEP_END,
    EventQueue,
    Requests,
    SimConfig,
)
from edgeinfer.sim.fleet import CLOCK0, MODEL, heartbeat, outage, refresh, warm_rates
from edgeinfer.sim.policies import Policy
from edgeinfer.sim.prefix_cache import BLOCK_TOKENS, FleetCaches
from edgeinfer.sim.profile import EngineProfile
from edgeinfer.sim.servers import Engine, Job
from edgeinfer.sim.topology import Topology
from edgeinfer.sim.workload import Workload

ROLES: tuple[Role, ...] = ("prefill", "decode", "both")


class EngineSummary(TypedDict):
    """One engine's totals over a run (seconds busy, and tokens)."""

    url: str
    pop: str
    role: Role
    busy_s: float
    prefill_s: float
    decode_s: float
    prompt_tokens: float
    generated_tokens: float


@dataclasses.dataclass
class SimResult:
    policy: str
    workload: Workload
    topology: Topology
    config: SimConfig
    requests: dict[str, np.ndarray]
    engines: list[EngineSummary]
    timeline: dict[str, list[float]]  # per 'role region': busy fraction per bucket
    counters: dict[str, float]
    received: dict[str, int]  # requests whose decode engine was in each PoP
    sim_end_s: float
    wall_s: float
    cpu_s: float  # this process's CPU time: the speed measure on a shared host


class Simulation:
    def __init__(self, topo: Topology, work: Workload, policy: Policy, prof: EngineProfile,
                 cfg: SimConfig) -> None:  # fmt: skip
        if len(work) == 0:
            raise SimError("the workload has no requests")
        self.topo, self.work, self.policy, self.prof, self.cfg = topo, work, policy, prof, cfg
        self.q = EventQueue()
        self.reqs = Requests(work.prompt.tolist(), work.output.tolist(), 16)
        self.engines: list[Engine] = []
        configs = []
        for pi, pop in enumerate(topo.pops):
            urls = []
            for role, count in zip(ROLES, (pop.split.prefill, pop.split.decode, pop.split.both)):
                for k in range(count):
                    url = f"http://{pop.name}-{role}{k}:8000"
                    urls.append(url)
                    self.engines.append(Engine(len(self.engines), url, pi, role, prof,
                                               cfg.kv_tokens_per_gpu, cfg.max_seqs, self.reqs, self))  # fmt: skip
            configs.append(PopConfig(pop.name, pop.lat, pop.lon, tuple(urls)))
        self.by_url = {e.url: e for e in self.engines}
        self.registry = PopRegistry(configs, topo.pops[0].name, cfg.heartbeat_interval_s)
        self.geo = PopGeometry({p.name: (p.lat, p.lon) for p in topo.pops}, cfg.net)
        self.inflight: list[set[int]] = [set() for _ in self.engines]
        self.hb_seq = [0] * len(self.engines)
        # Per engine: the load snapshot its heartbeats report (running, waiting, KV blocks
        # free, queued prompt tokens, in flight), refreshed on its own clock (fleet.refresh).
        self.stats: list[tuple[int, int, int, int, int]] = [(0, 0, 0, 0, 0)] * len(self.engines)
        self.incarnation = [1.7e9] * len(self.engines)
        rng = np.random.default_rng(cfg.seed)
        n = len(work)
        self.jitter = np.exp(rng.normal(0.0, cfg.jitter_sigma, (2, n))).tolist()
        self.c_xyz = unit_vectors(work.lat, work.lon)
        here = np.concatenate([np.argmax(self.c_xyz[i : i + 65536] @ self.geo.xyz.T, axis=1)
                               for i in range(0, n, 65536)])  # fmt: skip
        self.here = [topo.pops[k].name for k in here.tolist()]
        self.p_xyz = self.geo.xyz.tolist()
        self.counters = dict.fromkeys(
            ("failed_in_flight", "rejected", "connect_failures", "prefill_fallbacks",
             "kv_bytes_cross_pop", "kv_bytes_intra_pop", "remote_prefills",
             "prefix_blocks_asked", "prefix_blocks_hit", "prefix_blocks_pulled",
             "prefix_blocks_held", "kv_bytes_pulled"), 0.0)  # fmt: skip
        # Prefix caches only where requests name their blocks; prompt tokens each prefill found.
        self.blocks = work.blocks
        self.caches = (FleetCaches(len(self.engines), cfg.kv_tokens_per_gpu // BLOCK_TOKENS)
                       if work.blocks is not None else None)  # fmt: skip
        self.hit_tokens = [0] * n
        urls = [e.url for e in self.engines]
        caches = self.caches
        if caches is not None:
            policy.attach(lambda keys: {urls[e]: k for e, k in caches.hits(keys).items()})
        # Utilisation timeline per "role region" (e.g. "decode eu"): the sun moves per region.
        self._group = [f"{e.role} {topo.pops[e.pop].region}" for e in self.engines]
        self._group_count = {g: self._group.count(g) for g in dict.fromkeys(self._group)}
        self.buckets: dict[str, list[float]] = {g: [] for g in self._group_count}
        self._busy_mark = dict.fromkeys(self._group_count, 0.0)

    # ---- callbacks from engines ------------------------------------------------------
    def push(self, t: float, kind: int, a: int = 0, b: int = 0, c: float = 0.0) -> None:
        self.q.push(t, kind, a, b, c)

    def send_prefill(self, r: int, now: float) -> None:
        d, p = self.reqs.decode[r], self.reqs.prefill[r]
        rtt = self.geo.rtt[self.engines[d].pop, self.engines[p].pop] * self.jitter[1][r]
        self.q.push(now + rtt / 2, AT_PREFILL, r)

    def cached(self, r: int, e: int) -> int:
        """Prompt tokens of ``r`` engine ``e`` holds (its prefill skips them)."""
        if self.caches is None or self.blocks is None:
            return 0
        keys = self.blocks[r]
        hit = self.caches.lookup(e, keys)
        self.counters["prefix_blocks_asked"] += len(keys)
        self.counters["prefix_blocks_hit"] += hit
        self.hit_tokens[r] = cached_tokens(self.reqs.prompt[r], hit, BLOCK_TOKENS)
        return self.hit_tokens[r]

    def remote_start(self, r: int, p: Engine) -> tuple[int, float]:
        """Where ``r``'s prefill on ``p`` (for its decode engine) starts, in prompt tokens, and
        how long the pages it pulls from the decode engine take (0: none pulled)."""
        if self.caches is None or self.blocks is None:
            return 0, 0.0
        keys, tokens, c = self.blocks[r], self.reqs.prompt[r], self.counters
        de = self.engines[self.reqs.decode[r]]
        p_hit = self.caches.lookup(p.idx, keys)
        # D's hits are this request's own blocks there (allocated at admission), so they stay.
        d_hit = self.caches.lookup(de.idx, keys)
        start = cached_tokens(tokens, p_hit, BLOCK_TOKENS)
        hit, pull_s = p_hit, 0.0
        held = cached_tokens(tokens, d_hit, BLOCK_TOKENS)
        if held > start:
            prof, same = self.prof, p.pop == de.pop
            rate = prof.prefill_s(held - start, start) / (held - start)
            rtt = 0.0 if same else self.geo.rtt[p.pop, de.pop] * self.jitter[1][r]
            price = price_pull(self.cfg.net, tokens, start, held, rate, prof.kv_bytes_per_token,
                               rtt)  # fmt: skip
            if price.pull:
                moved = (held - start) * prof.kv_bytes_per_token
                c["prefix_blocks_pulled"] += d_hit - p_hit
                c["kv_bytes_pulled"] += moved
                c["kv_bytes_intra_pop" if same else "kv_bytes_cross_pop"] += moved
                start, hit, pull_s = held, d_hit, float(price.pull_s)
        c["prefix_blocks_asked"] += len(keys)
        c["prefix_blocks_hit"] += hit
        self.hit_tokens[r] = start
        return start, pull_s

    def computed(self, r: int, e: int) -> None:
        """Engine ``e`` has the KV of ``r``'s prompt (prefilled there, or its pages arrived)."""
        if self.caches is not None and self.blocks is not None:
            self.caches.insert(e, self.blocks[r])

    def prefilled(self, job: Job, now: float) -> None:
        r, d = job[0], job[2]
        pe, de = self.engines[self.reqs.prefill[r]], self.engines[d]
        tokens, prof, net = self.reqs.prompt[r], self.prof, self.cfg.net
        done = self.hit_tokens[r]
        compute = prof.prefill_s(tokens - done, done)
        # Only what D lacks moves (all of it without prefix caches).
        moved = tokens
        if self.caches is not None and self.blocks is not None:
            hit = self.caches.lookup(d, self.blocks[r])
            moved = tokens - cached_tokens(tokens, hit, BLOCK_TOKENS)
        same = pe.pop == de.pop
        link = net.kv_link_s(moved * prof.kv_bytes_per_token, same_pop=same)
        kv_s = float(net.kv_exposed_s(link, compute, moved, prof.max_num_batched_tokens))
        rtt = 0.0 if same else self.geo.rtt[pe.pop, de.pop] * self.jitter[1][r]
        key = "kv_bytes_intra_pop" if same else "kv_bytes_cross_pop"
        self.counters[key] += moved * prof.kv_bytes_per_token
        self.counters["remote_prefills"] += 1
        self.q.push(now + kv_s + rtt / 2, KV_ARRIVED, r)

    def finished(self, r: int, engine: Engine) -> None:
        self.inflight[engine.idx].discard(r)

    # ---- the loop -----------------------------------------------------------------------
    def run(self) -> SimResult:
        wall, cpu = time.perf_counter(), time.process_time()
        q, engines, cfg = self.q, self.engines, self.cfg
        self.last_arrival = float(self.work.t[-1])
        rng = np.random.default_rng(cfg.seed + 1)
        period = cfg.heartbeat_interval_s
        phases = rng.uniform(0, period, len(engines))
        refreshes = rng.uniform(0, period / 2, len(engines))
        slot = cfg.heartbeat_slot_s
        for e, phase, r in zip(engines, phases.tolist(), refreshes.tolist()):
            warm_rates(self, e)
            refresh(self, e)
            self._heartbeat(e, 0.0)  # a warm start: every daemon has spoken once
            q.push(round(phase / slot) * slot if slot > 0 else phase, HEARTBEAT, e.idx)
            q.push(r, STATS, e.idx)
        index = {p.name: i for i, p in enumerate(self.topo.pops)}
        for o in cfg.outages:
            if o.pop not in index or o.kind not in ("fail", "drain"):
                raise SimError(f"bad outage {o}: unknown PoP or kind")
            start, end = (POP_FAIL, POP_RECOVER) if o.kind == "fail" else (POP_DRAIN, POP_DRAIN)
            q.push(o.start_s, start, index[o.pop], 1)
            if o.end_s is not None:
                q.push(o.end_s, end, index[o.pop], 0)
        q.push(cfg.bucket_s, BUCKET)
        arrivals, n, i = self.work.t.tolist(), len(self.work), 0
        heap, pop, stop = q.heap, q.pop, self.last_arrival + cfg.drain_limit_s
        t = 0.0
        while True:
            if i < n and (not heap or arrivals[i] <= heap[0][0]):
                self._arrive(i, arrivals[i])
                i += 1
                continue
            if not heap or heap[0][0] > stop:
                break
            t, _, kind, a, b, _c = pop()
            if kind == STEP_END:
                e = engines[a]
                if e.step_id == b and e.alive:
                    e.step_end(t)
            elif kind == AT_DECODE:
                self._at_decode(a, t)
            elif kind == KV_ARRIVED:
                d = engines[self.reqs.decode[a]]
                if self.reqs.status[a] == PENDING and d.alive:
                    self.computed(a, d.idx)
                    d.join(a, t)
            elif kind == AT_PREFILL:
                self._at_prefill(a, t)
            elif kind == PULLED:
                self._pulled(a, b, t)
            elif kind == HEARTBEAT:
                self._heartbeat(engines[a], t)
                if t < self.last_arrival:
                    q.push(t + cfg.heartbeat_interval_s, HEARTBEAT, a)
            elif kind == STATS:
                refresh(self, engines[a])
                if t < self.last_arrival:
                    q.push(t + cfg.heartbeat_interval_s / 2, STATS, a)
            elif kind == BUCKET:
                self._bucket()
                if t < self.last_arrival or i < n:
                    q.push(t + cfg.bucket_s, BUCKET)
            else:
                self._outage(kind, a, b, t)
        return self._result(t, time.perf_counter() - wall, time.process_time() - cpu)

    def _arrive(self, r: int, now: float) -> None:
        reqs, work = self.reqs, self.work
        views = self.registry.snapshot(CLOCK0 + now)
        f = RequestFeatures(reqs.prompt[r], reqs.output[r], MODEL)
        lat, lon = float(work.lat[r]), float(work.lon[r])
        delay, pending = 0.0, self.registry.pending
        keys: Sequence[int] = self.blocks[r] if self.blocks is not None else ()
        if self.caches is not None and keys:
            # What any placement could have hit: the most leading blocks one daemon holds.
            self.counters["prefix_blocks_held"] += max(self.caches.hits(keys).values(), default=0)
        choices = self.policy.place(views, pending, lat, lon, f, self.here[r], CLOCK0 + now,
                                    keys)  # fmt: skip
        for k, (d_url, p_url) in enumerate(choices):
            d = self.by_url[d_url]
            if not d.alive:
                # The proxy's connect fails after a timeout; the daemon is out until it beats.
                self.registry.mark_down(d_url, CLOCK0 + now)
                self.counters["connect_failures"] += 1
                delay += self.cfg.connect_timeout_s
                continue
            if reqs.blocks[r] > d.kv_total:
                break
            reqs.decode[r] = d.idx
            reqs.prefill[r] = self.by_url[p_url].idx if p_url else -1
            cx, px = self.c_xyz[r], self.p_xyz[d.pop]
            dot = cx[0] * px[0] + cx[1] * px[1] + cx[2] * px[2]
            floor = float(self.cfg.net.rtt_floor_from_dot_s(dot))
            reqs.net[r] = rtt = floor * self.jitter[0][r]
            self.inflight[d.idx].add(r)
            self.policy.placed(k, f, pending, CLOCK0 + now + delay)
            self.q.push(now + delay + rtt / 2, AT_DECODE, r)
            return
        reqs.status[r] = REJECTED
        self.counters["rejected"] += 1

    def _at_decode(self, r: int, now: float) -> None:
        if self.reqs.status[r] == PENDING:  # else its engine failed while it was on the way
            self.engines[self.reqs.decode[r]].arrive(r, now)

    def _at_prefill(self, r: int, now: float) -> None:
        reqs = self.reqs
        if reqs.status[r] != PENDING:
            return
        p, d = self.engines[reqs.prefill[r]], reqs.decode[r]
        if not p.alive:
            self.fallback(r, now)
            return
        start, pull_s = self.remote_start(r, p)
        if pull_s > 0:
            self.q.push(now + pull_s, PULLED, r, start)
        else:
            p.enqueue([r, start, d], now)

    def _pulled(self, r: int, start: int, now: float) -> None:
        reqs = self.reqs
        if reqs.status[r] != PENDING:
            return
        p = self.engines[reqs.prefill[r]]
        if p.alive:
            p.enqueue([r, start, reqs.decode[r]], now)
        else:
            self.fallback(r, now)

    def fallback(self, r: int, now: float) -> None:
        """The prefill peer is gone: the decode daemon prefills itself (the daemon's fallback)."""
        self.counters["prefill_fallbacks"] += 1
        d = self.reqs.decode[r]
        self.reqs.prefill[r] = -1
        self.engines[d].enqueue([r, 0, d], now)

    def _heartbeat(self, e: Engine, now: float) -> None:
        heartbeat(self, e, now)

    def _outage(self, kind: int, pop: int, on: int, now: float) -> None:
        outage(self, kind, pop, on, now)

    def _bucket(self) -> None:
        busy = dict.fromkeys(self._group_count, 0.0)
        for e, g in zip(self.engines, self._group):
            busy[g] += e.stats[0]
        for g, count in self._group_count.items():
            frac = (busy[g] - self._busy_mark[g]) / (count * self.cfg.bucket_s)
            self.buckets[g].append(min(frac, 1.0))
            self._busy_mark[g] = busy[g]

    def _result(self, end: float, wall: float, cpu: float) -> SimResult:
        reqs = self.reqs.arrays()
        pending = reqs["status"] == PENDING
        self.counters["unfinished"] = float(pending.sum())
        self.counters["done"] = float((reqs["status"] == DONE).sum())
        placed = reqs["decode"][reqs["status"] != REJECTED]
        pops = np.bincount([self.engines[d].pop for d in placed.tolist()],
                           minlength=len(self.topo.pops))  # fmt: skip
        engines: list[EngineSummary] = [
            {"url": e.url, "pop": self.topo.pops[e.pop].name, "role": e.role, "busy_s": e.stats[0],
             "prefill_s": e.stats[1], "decode_s": e.stats[2], "prompt_tokens": e.stats[3],
             "generated_tokens": e.stats[4]}
            for e in self.engines
        ]  # fmt: skip
        return SimResult(
            policy=self.policy.name, workload=self.work, topology=self.topo, config=self.cfg,
            requests=reqs, engines=engines, timeline=self.buckets, counters=self.counters,
            received={p.name: int(c) for p, c in zip(self.topo.pops, pops.tolist())},
            sim_end_s=end, wall_s=wall, cpu_s=cpu,
        )  # fmt: skip


def simulate(topo: Topology, work: Workload, policy: Policy, prof: EngineProfile,
             cfg: SimConfig) -> SimResult:  # fmt: skip
    return Simulation(topo, work, policy, prof, cfg).run()
