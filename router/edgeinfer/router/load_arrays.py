"""The selector's inputs: every daemon's load as arrays, per snapshot, kept current per placement.

A registry snapshot changes only when a heartbeat (or an admin action) does; the arrays built
from it cost ~1 ms at 600 daemons, so they are built once per snapshot and model. Between
heartbeats the router's own placements change the load it should price
(:mod:`edgeinfer.router.inflight`): each one updates only the rows it touches (the decode
daemon, the prefill daemon and the decode daemons whose co-located prefill peer it is) in one
compiled call (:mod:`edgeinfer.router.load_update`), which derives a row with the code a build
derives every row with.

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
from edgeinfer.router.load_columns import DCol, DLoad, DState, PCol, PState, Row, Totals
from edgeinfer.router.load_update import apply_change, derive_all, pooled_bounds
from edgeinfer.router.network import (
    FloatArray,
    IntArray,
    PopGeometry,
)
from edgeinfer.router.placement import Assumed, PlacementConfig
from edgeinfer.router.pop_registry import DaemonView
from edgeinfer.router.session_affinity import AffinityRing

# Carried arrays are built afresh after this long (seconds on the registry's clock).
REBUILD_S = 1.0


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
        self._ns, self._nl = float(cfg.short_prompt_tokens), float(4 * cfg.prefill_chunk_tokens)
        # What deriving a row takes besides the arrays (load_update).
        self._consts = (cfg.itl_slo_s, float(cfg.mean_output_tokens), self._ns, self._nl)
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
        # The raw load that placements change (load_update), and what is derived from it.
        self.d_load: FloatArray = np.zeros((len(d), len(DLoad)))
        raw = self.d_load
        for col in ("RUNNING", "WAITING", "FREE_TOKENS", "DECODE_RATE", "ITL_P50_S",
                    "LOCAL_MAX_TOKENS"):  # fmt: skip
            raw[:, DLoad[col]] = dm[:, DCol[col]]
        raw[:, DLoad.MEASURED] = dm[:, DCol.MEASURED] > 0
        local_inv = raw[:, DLoad.LOCAL_S_PER_TOKEN] = 1.0 / dm[:, DCol.PREFILL_RATE]
        raw[:, DLoad.LOCAL_END] = queue_end(
            dm[:, DCol.REPORTED_AT], dm[:, DCol.QUEUED_PREFILL] * local_inv,
            dm[:, DCol.PENDING_PREFILL_S], dm[:, DCol.PENDING_END], now,
        )  # fmt: skip
        self.load: FloatArray = raw[:, DLoad.LOAD]  # running + waiting, a view
        self.totals: FloatArray = np.zeros(len(Totals))  # Totals, kept with the rows
        self.d_pop: IntArray = dm[:, DCol.POP].astype(np.intp)
        self.d_pop_list: list[int] = self.d_pop.tolist()
        # Per D, one row of what a decision reads (DState); the names below are views of it.
        self.d_state: FloatArray = np.zeros((len(d), len(Row) + len(DState)))
        self.row_arr: FloatArray = self.d_state[:, : len(Row)]  # Row's fields
        self.d_xyz: FloatArray = self.d_state[:, DState.X : DState.Z + 1]
        self.d_xyz[:] = geo.xyz[self.d_pop].reshape(len(d), 3)
        self.d_measured: FloatArray = self.d_state[:, DState.MEASURED_RTT_S]
        self.d_measured[:] = dm[:, DCol.RTT_S]  # RTT EWMA to the daemon's PoP, 0: none
        # Per P, when its queue ends and its seconds per token (PState); the names are views.
        self.p_state: FloatArray = np.zeros((len(p), len(PState)))
        self.p_inv: FloatArray = self.p_state[:, PState.S_PER_TOKEN]
        self.p_inv[:] = 1.0 / pm[:, PCol.RATE]
        self.p_inv_mean = float(self.p_inv.mean()) if len(p) else 0.0
        self.p_end: FloatArray = self.p_state[:, PState.END]
        self.p_end[:] = queue_end(
            pm[:, PCol.REPORTED_AT], pm[:, PCol.QUEUED_PREFILL] * self.p_inv,
            pm[:, PCol.PENDING_PREFILL_S], pm[:, PCol.PENDING_END], now,
        )  # fmt: skip
        self.p_pop: IntArray = pm[:, PCol.POP].astype(np.intp)
        self.p_pop_list: list[int] = self.p_pop.tolist()
        # As a Python list too (placements do not change it): the prefix path reads a few
        # dozen entries per decision, and a numpy scalar read costs several times a list's.
        self.p_inv_l: list[float] = self.p_inv.tolist()
        self.totals[Totals.POOLED_SHORT] = self.totals[Totals.POOLED_LONG] = math.inf
        self.pool: IntArray  # indices into p of the cheapest prefill daemons (module doc)
        self.p_pool: IntArray  # per P, its position in the pool (-1: none)
        self.pool_state: FloatArray  # [pool, PState] the pool's p_state rows (kept current)
        self.d_pool_rtt: FloatArray  # [D, pool] RTT, 0 within a PoP (no transfer)
        self._choose(t)

    def _choose(self, t: float) -> None:
        """Co-located peers and the prefill pool for the load at ``t``, then every row derived
        from the raw load (``d_load``): the build's last part, and a carry's."""
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
        # Per D, its URL and its peer's (None: no peer), for the index's questions (asked).
        p_urls = [v.url for v in self.p]
        self._d_urls = [v.url for v in self.d]
        self._colo_urls = [p_urls[c] if c >= 0 else None for c in self.colo]
        # The other way round: P j is the co-located peer of the D rows
        # colo_rows[colo_ptr[j]:colo_ptr[j + 1]] (rows by peer, a CSR pair).
        rows = np.flatnonzero(self.colo_arr >= 0)
        rows = rows[np.argsort(self.colo_arr[rows], kind="stable")]
        self.colo_rows: IntArray = rows.astype(np.intp)
        self.colo_ptr: IntArray = np.searchsorted(
            self.colo_arr[rows], np.arange(len(self.p) + 1)
        ).astype(np.intp)
        self._rank_pool(t)
        derive_all(t, self.d_load, self.d_state, self.colo_arr, self.p_state, self.totals,
                   *self._consts)  # fmt: skip

    def asked(self, rows: list[int]) -> set[str]:
        """The daemons whose caches the prefix index is asked about for decode ``rows``: them,
        their co-located prefill peers and the prefill pool (prefix_select)."""
        ask = set(self._pool_urls)
        d_urls, colo_urls = self._d_urls, self._colo_urls
        for i in rows:
            ask.add(d_urls[i])
            if (c := colo_urls[i]) is not None:
                ask.add(c)
        return ask

    def affinity_pick(self, key: int, pop: int, eps: float) -> int | None:
        """The session ``key``'s decode daemon (a row) among those of PoP ``pop`` (a geometry
        index): its ring of them, bounded by their load. Rings are built on first use."""
        ring = self._rings.get(pop)
        if ring is None:
            rows = np.flatnonzero(self.d_pop == pop).tolist()
            ring = self._rings[pop] = (rows, AffinityRing([self.d[r].url for r in rows]))
        rows, r = ring
        at = r.pick(key, self.load[rows].tolist(), eps)
        return rows[at] if at is not None else None

    def _rank_pool(self, t: float) -> None:
        cfg, k = self.cfg, self.cfg.prefill_pool
        q = np.maximum(self.p_end - t, 0.0)
        sizes = (cfg.short_prompt_tokens, 8 * cfg.prefill_chunk_tokens)
        ranked = [np.argsort(q + n * self.p_inv, kind="stable")[:k] for n in sizes]
        self.pool = np.unique(np.concatenate(ranked)).astype(np.intp)
        self.pool_list: list[int] = self.pool.tolist()
        self._pool_urls = frozenset(self.p[j].url for j in self.pool_list)
        self.p_pool = np.full(len(self.p), -1, dtype=np.intp)
        self.p_pool[self.pool] = np.arange(len(self.pool))
        self.pool_state = np.stack((self.p_end[self.pool], self.p_inv[self.pool]), axis=1)
        self.d_pool_rtt = self.geo.rtt[:, self.p_pop[self.pool]][self.d_pop]
        # The cheapest pooled prefill for a short and a long prompt: the lower bound that
        # pruning uses for every D.
        bounds = pooled_bounds(self.pool_state, t, self._ns, self._nl)
        self.totals[Totals.POOLED_SHORT], self.totals[Totals.POOLED_LONG] = bounds
        # What apply_change takes after a change's own figures: the arrays (new with peers and
        # pool, which this runs after) and the constants.
        self._update_args = (self.d_load, self.d_state, self.colo_arr, self.colo_ptr,
                             self.colo_rows, self.p_state, self.p_pool, self.pool_state,
                             self.totals, *self._consts)  # fmt: skip

    def apply(self, changes: list[Change], version: int) -> None:
        """Placements (or their ends) since the build: update the rows they touch."""
        d_of, p_of, arrays = self.d_of, self.p_of, self._update_args
        for url, seqs, kv, prefill, t in changes:
            i = d_of.get(url, -1)
            j = p_of.get(url, -1) if prefill else -1
            if i >= 0 or j >= 0:
                apply_change(i, j, seqs, kv, prefill, t, *arrays)
        self.version = version

    @property
    def load_sum(self) -> float:
        """The decode rows' load summed (the load guard's mean)."""
        return float(self.totals[Totals.LOAD_SUM])

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
        """Row ``i``'s raw load from its view (``derive_all`` turns it into the decision's row)."""
        inv, end, seqs, kv = self._reported(v, now)
        self.d[i] = v
        self.d_load[i, : DLoad.STATIC] = (
            v.running + seqs, float(v.waiting), v.kv_blocks_free * v.block_size - kv,
            v.decode_tokens_per_s or self.assumed.decode_tokens_per_s,
            v.itl_p50_s or self.assumed.itl_s, float(v.decode_tokens_per_s > 0),
            math.inf if v.role == "both" else float(v.local_prefill_threshold), inv, end,
        )  # fmt: skip
        self.d_measured[i] = v.rtt_s or 0.0

    def _reload_p(self, j: int, v: DaemonView, now: float | None) -> None:
        """Prefill daemon ``j``'s rate and queue from its view."""
        inv, end, _, _ = self._reported(v, now)
        self.p[j] = v
        self.p_inv[j] = self.p_inv_l[j] = inv
        self.p_end[j] = end
        self.p_inv_mean = float(self.p_inv.mean())
