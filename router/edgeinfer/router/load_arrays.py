"""The selector's inputs: every daemon's load as arrays, per snapshot, kept current per placement.

A registry snapshot changes only when a heartbeat (or an admin action) does; the arrays built
from it cost ~1 ms at 600 daemons, so they are built once per snapshot and model. Between
heartbeats the router's own placements change the load it should price
(:mod:`edgeinfer.router.inflight`): each one updates only the rows it touches (the decode
daemon, the prefill daemon and the decode daemons whose co-located prefill peer it is) in plain
Python, which must agree with the vectorized build (a test checks it does).

Prefill queues are kept as the time they end (``*_end``, on the registry's clock): a daemon works
through its queue at its rate, so the queue a heartbeat reported is ``end - now`` seconds long a
moment later, and a placement of n tokens moves the end to ``max(end, now) + n / rate``. A
build puts the pending placements behind the reported queue in the same way, as a FIFO does
(:func:`queue_end`), so carried arrays and a build price the same queue at any time. Without
the drain, placements added since a heartbeat (5 s ago) would pile up on queues long worked
off, and every prefill daemon would look seconds busier than it is. The snapshot a heartbeat
reports was taken on average half the daemons' report lag before it arrived. Decode load
(running sequences, free KV) is not drained: finishing requests are not predicted, so it errs
busy until the next heartbeat. Without a clock (``now`` None) queues are priced as reported.

Remote prefill is priced per D against its best *co-located* prefill daemon (no transfer) and a
pool of the cheapest ones for a short and for a long prompt: a far prefill daemon that is
neither cheap nor near can only lose, its pages must travel. Pool and co-located peers are
chosen per snapshot (every heartbeat: ~100 a second at 600 daemons, and with few daemons every
prefill daemon is in the pool); between, they are priced as placements load them, while a
daemon outside them that has become the cheaper one waits for the next snapshot. The pruning
keys are exact for the rows a placement touched and lower bounds elsewhere.

What a decision reads of each decode daemon (its row, both keys, its PoP's unit vector and
measured RTT) is one row of ``d_state`` (``DState``), and of the pool ``pool_state``
(``PState``): the compiled decision (:mod:`edgeinfer.router.candidate_cut`) takes three arrays,
not a dozen, and a placement rewrites a row in one assignment.

Most snapshots differ from the one before only in the load a few daemons reported (the
registry's ``Snapshot.base`` and ``changed``): then the arrays are carried over instead of built
again: the journal of placements is applied, the raw load of the daemons that reported is read
again from their heartbeats and the ledger, as the build reads every daemon's, and peers, pool
and rows are derived from the raw load as the build derives them. What is skipped is the
build's reading of every view and of the ledger's totals. A full build comes with any change of
availability and at least every ``REBUILD_S`` seconds (float sums drift, however little).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from edgeinfer.router.inflight import Change, PlacementLedger
from edgeinfer.router.load_columns import DCol, DState, PCol, PState, Row
from edgeinfer.router.network import (
    FloatArray,
    IntArray,
    PopGeometry,
)
from edgeinfer.router.placement import Assumed, PlacementConfig
from edgeinfer.router.pop_registry import DaemonView
from edgeinfer.router.session_affinity import AffinityRing

BIG = 1e6  # added to the score of a candidate over the ITL SLO: it ranks after all within it
# Carried arrays are built afresh after this long (seconds on the registry's clock).
REBUILD_S = 1.0
# d_state's first columns: Row's fields then both keys (an int: IntEnum arithmetic is slow).
_ROW_AND_KEYS = int(DState.KEY_LONG) + 1


def queue_end(reported_at: Any, queued_s: Any, pending_s: Any, pending_end: Any,
              now: float | None) -> Any:  # fmt: skip
    """When each daemon's prefill queue ends: first what it reported (``queued_s`` from
    ``reported_at``), then, in the order placed, what this router placed since
    (``pending_s``; alone it would end at ``pending_end``, each started when placed). A FIFO
    of both ends at ``max(reported_at + queued_s + pending_s, pending_end)``: the reported work
    then all the pending back to back, unless the pending started later than that and runs to
    its own end. No earlier than ``now``; without a clock, the seconds queued. Arrays (a
    build) or one daemon's floats (a carried row read again)."""
    if now is None:
        return queued_s + pending_s
    return np.maximum(np.maximum(reported_at + queued_s + pending_s, pending_end), now)


class LoadArrays:
    """Per-snapshot, per-model load of the available daemons; ``d_*`` has one entry per
    decode-capable daemon, ``p_*`` per daemon that can prefill for others."""

    def __init__(
        self, views: Sequence[DaemonView], model: str, geo: PopGeometry, cfg: PlacementConfig,
        pending: PlacementLedger | None, now: float | None,
    ) -> None:  # fmt: skip
        self.cfg, self.geo, self.model = cfg, geo, model
        # The pruning keys' reference prompts: short, and four prefill chunks.
        self._ns, self._nl = cfg.short_prompt_tokens, 4 * cfg.prefill_chunk_tokens
        self.pending = pending  # read at decision time too: recent placements break ties
        self.version = pending.version if pending is not None else 0
        self.built_at = now  # the full build's clock (None: no clock), see REBUILD_S
        t = now if now is not None else 0.0
        age = pending.report_lag_s / 2 if pending is not None else 0.0
        self._age = age
        mine = [v for v in views if v.available and v.model == model]
        self.assumed = assumed = Assumed(mine, cfg)  # for those not measured yet
        self.d = d = [v for v in mine if v.role in ("decode", "both")]
        self.p = p = [v for v in mine if v.role in ("prefill", "both") and v.kv_endpoint]
        self.d_of = {v.url: i for i, v in enumerate(d)}
        self.p_of = {v.url: i for i, v in enumerate(p)}
        # The daemons' own invariants (heartbeat v2); one model's daemons share them, so the
        # largest stands for all.
        self.kv_bytes_per_token = max((v.kv_bytes_per_token for v in mine), default=1)
        self.chunk_tokens = max((v.prefill_chunk_tokens for v in mine), default=1)
        self._rings: dict[int, tuple[list[int], AffinityRing]] = {}

        # One pass per side into a 2-D array: this runs per heartbeat (~100/s at 600 daemons).
        dm = np.asarray([
            (v.running, v.waiting, v.kv_blocks_free * v.block_size,
             v.prefill_tokens_per_s or assumed.prefill_tokens_per_s,
             v.decode_tokens_per_s or assumed.decode_tokens_per_s,
             v.queued_prefill_tokens, 0.0, v.last_seen or 0.0, v.rtt_s or 0.0,
             v.itl_p50_s or assumed.itl_s,
             math.inf if v.role == "both" else v.local_prefill_threshold, geo.index[v.pop],
             v.decode_tokens_per_s > 0, -math.inf)
            for v in d
        ], dtype=np.float64).reshape(len(d), len(DCol))  # fmt: skip
        pm = np.asarray([
            (v.prefill_tokens_per_s or assumed.prefill_tokens_per_s, v.queued_prefill_tokens,
             0.0, v.last_seen or 0.0, geo.index[v.pop], -math.inf)
            for v in p
        ], dtype=np.float64).reshape(len(p), len(PCol))  # fmt: skip
        # What this router placed since: sequences and KV on D, and on whoever prefills the
        # prefill work in seconds and when it would end alone (queue_end takes both).
        d_of, p_of = self.d_of, self.p_of
        on_d, on_p = [], []
        for url, (seqs, kv, tokens), end in pending.items() if pending is not None else ():
            if (i := d_of.get(url)) is not None:
                on_d.append((i, seqs, kv, tokens, end))
            if (j := p_of.get(url)) is not None:
                on_p.append((j, tokens, end))
        if on_d:
            i_, seqs_, kv_, tokens_, end_ = np.asarray(on_d).T
            i = i_.astype(np.intp)
            dm[i, DCol.RUNNING] += seqs_
            dm[i, DCol.FREE_TOKENS] -= kv_
            dm[i, DCol.PENDING_PREFILL_S] = tokens_ / dm[i, DCol.PREFILL_RATE]
            dm[i, DCol.PENDING_END] = end_
        if on_p:
            j_, tokens_, end_ = np.asarray(on_p).T
            j = j_.astype(np.intp)
            pm[j, PCol.PENDING_PREFILL_S] = tokens_ / pm[j, PCol.RATE]
            pm[j, PCol.PENDING_END] = end_
        # When the snapshot a heartbeat carried was taken, on average (see the module doc).
        dm[:, DCol.REPORTED_AT] -= age
        pm[:, PCol.REPORTED_AT] -= age
        # Raw load as Python lists: per-placement updates read and write them one at a time.
        cols = dm.T.tolist()
        self.running, self.waiting, self.free = (
            cols[DCol.RUNNING],
            cols[DCol.WAITING],
            cols[DCol.FREE_TOKENS],
        )
        self.d_rate, self.p50 = cols[DCol.DECODE_RATE], cols[DCol.ITL_P50_S]
        local_inv = 1.0 / dm[:, DCol.PREFILL_RATE]
        self.local_inv = local_inv.tolist()
        local_end = queue_end(
            dm[:, DCol.REPORTED_AT], dm[:, DCol.QUEUED_PREFILL] * local_inv,
            dm[:, DCol.PENDING_PREFILL_S], dm[:, DCol.PENDING_END], now,
        )  # fmt: skip
        self.local_end = local_end.tolist()
        self.local_max = cols[DCol.LOCAL_MAX_TOKENS]
        self.measured = [x > 0 for x in cols[DCol.MEASURED]]
        self.d_pop: IntArray = dm[:, DCol.POP].astype(np.intp)
        self.d_pop_list: list[int] = self.d_pop.tolist()
        # Per D, one row of what a decision reads (DState); the names below are views of it.
        self.d_state: FloatArray = np.zeros((len(d), len(Row) + len(DState)))
        self.row_arr: FloatArray = self.d_state[:, : len(Row)]  # Row's fields
        self.key_short: FloatArray = self.d_state[:, DState.KEY_SHORT]
        self.key_long: FloatArray = self.d_state[:, DState.KEY_LONG]
        self.d_xyz: FloatArray = self.d_state[:, DState.X : DState.Z + 1]
        self.d_xyz[:] = geo.xyz[self.d_pop].reshape(len(d), 3)
        self.d_measured: FloatArray = self.d_state[:, DState.MEASURED_RTT_S]
        self.d_measured[:] = dm[:, DCol.RTT_S]  # RTT EWMA to the daemon's PoP, 0: none
        self.p_inv: FloatArray = 1.0 / pm[:, PCol.RATE]
        self.p_inv_mean = float(self.p_inv.mean()) if len(p) else 0.0
        self.p_end: FloatArray = queue_end(
            pm[:, PCol.REPORTED_AT], pm[:, PCol.QUEUED_PREFILL] * self.p_inv,
            pm[:, PCol.PENDING_PREFILL_S], pm[:, PCol.PENDING_END], now,
        )  # fmt: skip
        self.p_pop: IntArray = pm[:, PCol.POP].astype(np.intp)
        self.p_pop_list: list[int] = self.p_pop.tolist()
        # As Python lists too (p_end_l kept equal to p_end): the prefix path reads a few dozen
        # entries per decision, and a numpy scalar read costs several times a list's.
        self.p_end_l: list[float] = self.p_end.tolist()
        self.p_inv_l: list[float] = self.p_inv.tolist()
        self.pooled_short = self.pooled_long = math.inf
        self.pool: IntArray  # indices into p of the cheapest prefill daemons (module doc)
        self.pool_at: dict[int, int]  # index into p -> position in the pool
        self.pool_state: FloatArray  # [pool, PState] the pool's p_end (kept current) and p_inv
        self.pool_inv: FloatArray  # [pool] views of pool_state's columns
        self.pool_end: FloatArray
        self.d_pool_rtt: FloatArray  # [D, pool] RTT, 0 within a PoP (no transfer)
        self._choose(t)

    def _choose(self, t: float) -> None:
        """Co-located peers and the prefill pool for the load at ``t``, then every row derived
        from the raw load (the lists above): the build's last part, and a carry's."""
        cfg = self.cfg
        # Per D: index into p of its PoP's best prefill daemon, judged on one chunk (queues differ
        # more than speeds), -1 if none. Chosen per snapshot, like the pool.
        chunk_cost = np.maximum(self.p_end - t, 0.0) + cfg.prefill_chunk_tokens * self.p_inv
        best: dict[int, int] = {}
        costs = chunk_cost.tolist()
        for k, g in enumerate(self.p_pop_list):
            if g not in best or costs[k] < costs[best[g]]:
                best[g] = k
        self.colo = [best.get(g, -1) for g in self.d_pop_list]
        self.colo_arr: IntArray = np.asarray(self.colo, dtype=np.intp)
        # The other way round: per prefill daemon, the D rows it is the co-located peer of.
        self.colo_rows: dict[int, list[int]] = {}
        for i, c in enumerate(self.colo):
            if c >= 0:
                self.colo_rows.setdefault(c, []).append(i)
        self._rank_pool(t)
        self._derive_all(t)

    # ---- the vectorized build ----------------------------------------------------------
    def _derive_all(self, t: float) -> None:
        cfg = self.cfg
        running, waiting, free = (
            np.asarray(self.running, dtype=np.float64),
            np.asarray(self.waiting, dtype=np.float64),
            np.asarray(self.free, dtype=np.float64),
        )
        d_rate = np.asarray(self.d_rate, dtype=np.float64)
        p50 = np.asarray(self.p50, dtype=np.float64)
        measured = np.asarray(self.measured, dtype=bool)
        local_max = np.asarray(self.local_max, dtype=np.float64)
        local_inv = np.asarray(self.local_inv, dtype=np.float64)
        local_end = np.asarray(self.local_end, dtype=np.float64)
        # Aggregate rate R at batch B means a step of B/R; one more sequence makes it (B+1)/R.
        itl = np.where((running > 0) & measured, (running + 1) / d_rate, p50)
        penalty = np.where(itl <= cfg.itl_slo_s, 0.0, BIG + itl)
        admit_wait = (waiting + 1.0) * cfg.mean_output_tokens / d_rate
        # Requests wait, or what was placed since the heartbeat has used up the free KV.
        self.d_static = penalty + np.where((waiting > 0) | (free <= 0), admit_wait, 0.0)
        local_q = np.maximum(local_end - t, 0.0)
        colo = self.colo_arr
        has = colo >= 0
        colo_end = np.where(has, self.p_end[colo] if len(self.p) else 0.0, math.inf)
        colo_inv = np.where(has, self.p_inv[colo] if len(self.p) else 0.0, 0.0)
        colo_q = np.maximum(colo_end - t, 0.0)
        ns, nl = cfg.short_prompt_tokens, 4 * cfg.prefill_chunk_tokens
        # Pruning keys: exact at the time of the build or of the row's last update.
        short_ok, long_ok = (
            np.where(ns <= local_max, 0.0, math.inf),
            np.where(nl <= local_max, 0.0, math.inf),
        )
        self.own_short = np.minimum(local_q + ns * local_inv + short_ok, colo_q + ns * colo_inv)
        self.own_long = np.minimum(local_q + nl * local_inv + long_ok, colo_q + nl * colo_inv)
        self._keys()
        # In the order of Row.
        free_col = np.where(waiting > 0, -1.0, free)
        cols = (free_col, admit_wait, local_end, local_inv, local_max, colo_end, colo_inv, penalty,
                itl)  # fmt: skip
        # Rows as an array (the compiled decision's) and as Python tuples (the prefix path
        # reads a few dozen); a placement rewrites one or two of each.
        self.row_arr[:] = np.stack(cols, axis=1).reshape(len(self.d), len(Row))
        self.d_rows: list[tuple[float, ...]] = list(map(tuple, self.row_arr.tolist()))
        self.load = (running + waiting).tolist()  # for the power-of-two choice
        # Their total, kept with them (the load guard's mean): loads are counts, sums exact.
        self.load_sum = float(sum(self.load))

    # ---- one row at a time (must compute what _derive_all does) -----------------------
    def _derive(self, i: int, t: float) -> None:
        # Runs for every placement (one or two rows): conditional expressions, not max()/min().
        cfg = self.cfg
        running, waiting, free = self.running[i], self.waiting[i], self.free[i]
        rate = self.d_rate[i]
        itl = (running + 1) / rate if running > 0 and self.measured[i] else self.p50[i]
        penalty = 0.0 if itl <= cfg.itl_slo_s else BIG + itl
        admit_wait = (waiting + 1.0) * cfg.mean_output_tokens / rate
        static = penalty + admit_wait if waiting > 0 or free <= 0 else penalty
        local_inv, local_end = self.local_inv[i], self.local_end[i]
        local_q = local_end - t if local_end > t else 0.0
        local_max = self.local_max[i]
        c = self.colo[i]
        if c >= 0:
            colo_end, colo_inv = self.p_end_l[c], self.p_inv_l[c]
            colo_q = colo_end - t if colo_end > t else 0.0
        else:
            colo_end, colo_inv, colo_q = math.inf, 0.0, math.inf
        ns, nl = self._ns, self._nl
        own_short = local_q + ns * local_inv if ns <= local_max else math.inf
        if colo_q + ns * colo_inv < own_short:
            own_short = colo_q + ns * colo_inv
        own_long = local_q + nl * local_inv if nl <= local_max else math.inf
        if colo_q + nl * colo_inv < own_long:
            own_long = colo_q + nl * colo_inv
        self.d_static[i], self.own_short[i], self.own_long[i] = static, own_short, own_long
        pooled_short, pooled_long = self.pooled_short, self.pooled_long
        self.d_rows[i] = row = (-1.0 if waiting > 0 else free, admit_wait, local_end, local_inv,
                                local_max, colo_end, colo_inv, penalty, itl)  # fmt: skip
        # The row and both keys (DState's first columns) in one write.
        self.d_state[i, :_ROW_AND_KEYS] = (*row,
            static + (own_short if own_short < pooled_short else pooled_short),
            static + (own_long if own_long < pooled_long else pooled_long))  # fmt: skip
        self.load_sum += running + waiting - self.load[i]
        self.load[i] = running + waiting

    def affinity_pick(self, key: int, pop: int, eps: float) -> int | None:
        """The session ``key``'s decode daemon (a row) among those of PoP ``pop`` (a geometry
        index): its ring of them, bounded by their load. Rings are built on first use."""
        ring = self._rings.get(pop)
        if ring is None:
            rows = np.flatnonzero(self.d_pop == pop).tolist()
            ring = self._rings[pop] = (rows, AffinityRing([self.d[r].url for r in rows]))
        rows, r = ring
        at = r.pick(key, [self.load[i] for i in rows], eps)
        return rows[at] if at is not None else None

    def _keys(self) -> None:
        """Pruning keys without the network: a lower bound of each D's cost for a short and a
        long prompt (SLO penalty, admission, cheapest prefill of its own, co-located or pooled)."""
        self.key_short[:] = self.d_static + np.minimum(self.own_short, self.pooled_short)
        self.key_long[:] = self.d_static + np.minimum(self.own_long, self.pooled_long)

    def _rank_pool(self, t: float) -> None:
        cfg, k = self.cfg, self.cfg.prefill_pool
        q = np.maximum(self.p_end - t, 0.0)
        sizes = (cfg.short_prompt_tokens, 8 * cfg.prefill_chunk_tokens)
        ranked = [np.argsort(q + n * self.p_inv, kind="stable")[:k] for n in sizes]
        self.pool = np.unique(np.concatenate(ranked)).astype(np.intp)
        self.pool_list: list[int] = self.pool.tolist()
        self.pool_at = {j: k for k, j in enumerate(self.pool.tolist())}
        self.pool_state = np.stack((self.p_end[self.pool], self.p_inv[self.pool]), axis=1)
        self.pool_end = self.pool_state[:, PState.END]
        self.pool_inv = self.pool_state[:, PState.S_PER_TOKEN]
        self.d_pool_rtt = self.geo.rtt[:, self.p_pop[self.pool]][self.d_pop]
        self._pooled(t)

    def _pooled(self, t: float) -> bool:
        """The cheapest pooled prefill for a short and a long prompt: the lower bound that
        pruning uses for every D. True if it moved (the keys must follow)."""
        cfg, inv = self.cfg, self.pool_inv
        q = np.maximum(self.pool_end - t, 0.0)
        sizes = (cfg.short_prompt_tokens, 4 * cfg.prefill_chunk_tokens)
        short, long = (float((q + n * inv).min()) if len(self.pool) else math.inf for n in sizes)
        changed = (short, long) != (self.pooled_short, self.pooled_long)
        self.pooled_short, self.pooled_long = short, long
        return changed

    def apply(self, changes: list[Change], version: int) -> None:
        """Placements (or their ends) since the build: update the rows they touch."""
        rows: dict[int, float] = {}  # D rows to derive again, and as of when
        for url, seqs, kv, prefill, t in changes:
            if (i := self.d_of.get(url)) is not None:
                self.running[i] += seqs
                self.free[i] -= kv
                if prefill:
                    end = self.local_end[i]
                    self.local_end[i] = (max(end, t) if prefill > 0 else end) + (
                        prefill * self.local_inv[i]
                    )
                rows[i] = t
            if prefill and (j := self.p_of.get(url)) is not None:
                # An idle daemon starts on new work now; work taken back leaves the rest.
                end = self.p_end_l[j]
                end = (max(end, t) if prefill > 0 else end) + prefill * self.p_inv_l[j]
                self.p_end[j] = self.p_end_l[j] = end
                if (k := self.pool_at.get(j)) is not None:
                    self.pool_end[k] = end
                    # More work only raises the pooled minima, so the bounds stand; less may not.
                    if prefill < 0 and self._pooled(t):
                        self._keys()
                # The decode daemons it is the co-located prefill peer of are priced anew.
                for row in self.colo_rows.get(j, ()):
                    rows[row] = t
        for row, t in rows.items():
            self._derive(row, t)
        self.version = version

    # ---- carried over to the next snapshot ------------------------------------------
    def carry(self, changed: Sequence[DaemonView], now: float | None) -> bool:
        """Take the next snapshot's load: the journal since this build, then the rows of
        ``changed`` (the daemons whose heartbeats the snapshot added) read again as the build
        reads them. False when only a full build will do: too old (``REBUILD_S``), the journal
        trimmed, or a daemon that joined, left or changed what it serves (the registry marks
        those snapshots, this checks)."""
        pending = self.pending
        if now is not None and (self.built_at is None or now - self.built_at >= REBUILD_S):
            return False
        changes = pending.changes_since(self.version) if pending is not None else []
        if changes is None:
            return False
        rows = []
        for v in changed:
            mine = v.available and v.model == self.model
            i, j = self.d_of.get(v.url), self.p_of.get(v.url)
            if (
                (i is not None) != (mine and v.role in ("decode", "both"))
                or (j is not None) != (mine and v.role in ("prefill", "both") and bool(v.kv_endpoint))
                or v.kv_bytes_per_token > self.kv_bytes_per_token
                or v.prefill_chunk_tokens > self.chunk_tokens
            ):  # fmt: skip
                return False
            rows.append((v, i, j))
        if changes:
            self.apply(changes, pending.version if pending is not None else 0)
        for v, i, j in rows:
            if j is not None:
                self._reload_p(j, v, now)
            if i is not None:
                self._reload_d(i, v, now)
        self._choose(now if now is not None else 0.0)  # peers and pool follow the load
        return True

    def _reported(self, v: DaemonView, now: float | None) -> tuple[float, float, float, float]:
        """What the build reads of daemon ``v``: seconds per prefill token, when its prefill
        queue ends (the reported queue drained since it was reported, then this router's
        pending prefill), and its pending sequences and KV tokens."""
        rate = v.prefill_tokens_per_s or self.assumed.prefill_tokens_per_s
        inv = 1.0 / rate
        queued = v.queued_prefill_tokens * inv
        seqs, kv, tokens = self.pending.totals(v.url) if self.pending is not None else (0, 0, 0)
        if now is None:
            return inv, queued + tokens * inv, seqs, kv
        alone = self.pending.prefill_end(v.url) if self.pending is not None else -math.inf
        end = queue_end((v.last_seen or 0.0) - self._age, queued, tokens * inv, alone, now)
        return inv, float(end), seqs, kv

    def _reload_d(self, i: int, v: DaemonView, now: float | None) -> None:
        """Row ``i``'s raw load from its view (``_derive`` turns it into the decision's row)."""
        inv, end, seqs, kv = self._reported(v, now)
        self.d[i] = v
        self.running[i] = v.running + seqs
        self.waiting[i] = float(v.waiting)
        self.free[i] = v.kv_blocks_free * v.block_size - kv
        self.d_rate[i] = v.decode_tokens_per_s or self.assumed.decode_tokens_per_s
        self.p50[i] = v.itl_p50_s or self.assumed.itl_s
        self.measured[i] = v.decode_tokens_per_s > 0
        self.local_max[i] = math.inf if v.role == "both" else float(v.local_prefill_threshold)
        self.d_measured[i] = v.rtt_s or 0.0
        self.local_inv[i], self.local_end[i] = inv, end

    def _reload_p(self, j: int, v: DaemonView, now: float | None) -> None:
        """Prefill daemon ``j``'s rate and queue from its view."""
        inv, end, _, _ = self._reported(v, now)
        self.p[j] = v
        self.p_inv[j] = self.p_inv_l[j] = inv
        self.p_end[j] = self.p_end_l[j] = end
        self.p_inv_mean = float(self.p_inv.mean())
