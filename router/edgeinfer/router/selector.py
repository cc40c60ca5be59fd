"""Placement policy: which prefill daemon P and decode daemon D serve a request. Pure, no I/O.

The request path is client -> router -> D; D asks P for the prompt's KV (``x-edge-prefill``), P
pushes the pages to D, D streams tokens back. So, per candidate:

    TTFT = RTT(client, D)                      request in, first token out
         + admission at D                      0 if D has room now, else its queue drains
         + prefill queue at P + compute at P   queued tokens and this prompt at P's rate
         + KV transfer P -> D                  RTT(P, D) + pages not hidden behind compute
    ITL  = (running + 1) / decode rate of D    (else its measured median, else a default)

"Local" prefill (P = D) skips the transfer; a ``both`` daemon may always do it, a ``decode`` one
only for prompts up to ``local_prefill_max_tokens``. Request bytes are left out: ~5 bytes per
prompt token against ~100 KB of KV, and the same for every candidate.

Rank: candidates meeting the ITL SLO by TTFT; if none does, the least bad (ITL + TTFT). Among
candidates within ``near_tie_s`` of the best, two are drawn at random and the less loaded wins
(power of two choices), so routers reading the same heartbeats do not herd onto one daemon. The
answer has one placement per decode daemon, best first, so the proxy's retries go elsewhere.

Speed: arrays of every daemon's load are built once per registry snapshot (the registry returns
the same list object until something changes; PoP geometry is kept until a reload). A decision
ranks every D by network RTT plus a static key (SLO penalty, admission, cheapest prefill for a
reference prompt), keeps the ``decode_candidates`` best and prices those exactly: the prefill
pool in one small numpy matrix, the rest in plain Python.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter
from collections.abc import Sequence

import numpy as np

from edgeinfer.router.geo import GeoPoint
from edgeinfer.router.network import (
    EARTH_RADIUS_KM,
    FloatArray,
    IntArray,
    NetworkModel,
    PopGeometry,
    pop_geometry,
)
from edgeinfer.router.pop_registry import DaemonView

_BIG = 1e6  # added to the score of a candidate over the ITL SLO: it ranks after all within it


@dataclasses.dataclass(frozen=True, slots=True)
class RequestFeatures:
    prompt_tokens: int
    max_tokens: int
    model: str | None  # None: the most widely served model


@dataclasses.dataclass(frozen=True)
class PlacementConfig:
    itl_slo_s: float = 0.1
    near_tie_s: float = 0.02
    # bf16 Llama-3-8B: 32 layers x 8 KV heads x 128 dims x (K, V) x 2 bytes.
    kv_bytes_per_token: int = 131_072
    local_prefill_max_tokens: int = 512  # keep equal to the daemons' local_prefill_threshold
    prefill_chunk_tokens: int = 2048  # the last chunk's pages cannot hide behind compute
    # Used until a daemon has measured itself (rates are 0 in its first heartbeats).
    default_prefill_tokens_per_s: float = 5000.0
    default_decode_tokens_per_s: float = 1000.0
    default_itl_s: float = 0.03
    mean_output_tokens: int = 256  # how long a running request holds its slot, on average
    decode_candidates: int = 8  # D kept after the lower-bound pass
    prefill_pool: int = 8  # cheapest prefill daemons priced for every kept D (per prompt size)


@dataclasses.dataclass(frozen=True, slots=True)
class Placement:
    prefill: DaemonView | None  # None: the decode daemon prefills locally
    decode: DaemonView
    ttft_s: float
    itl_s: float
    meets_slo: bool
    breakdown: dict[str, float]  # the TTFT terms (they sum to ttft_s) and itl_s

    def describe(self) -> str:
        b = {k: round(v * 1000, 1) for k, v in self.breakdown.items()}
        where = "local" if self.prefill is None else f"{self.prefill.url} ({self.prefill.pop})"
        slo = "" if self.meets_slo else " OVER SLO"
        return (
            f"decode {self.decode.url} ({self.decode.pop}) prefill {where}: ttft "
            f"{self.ttft_s * 1000:.1f}ms = net {b['net_s']} + admit {b['admission_s']} + queue "
            f"{b['prefill_queue_s']} + compute {b['prefill_compute_s']} + kv {b['kv_s']}; "
            f"itl {b['itl_s']}ms{slo}"
        )


@dataclasses.dataclass
class _Arrays:
    """Per-snapshot, per-model inputs of the cost model; ``d_*`` has one entry per available
    decode-capable daemon. Remote prefill is priced per D against its best *co-located* prefill
    daemon (no transfer) and a pool of the cheapest ones for a short and for a long prompt: a
    far prefill daemon that is neither cheap nor near can only lose, its pages must travel."""

    d: list[DaemonView]
    d_xyz: FloatArray
    d_measured: FloatArray  # router's RTT EWMA to the daemon's PoP, 0 when unmeasured
    # Per D: free_tokens (-1 when requests wait), admit_wait_s, local_q_s, local_s_per_token,
    # local_limited (inf: only short prompts may prefill locally), colo_q_s (inf: none),
    # colo_s_per_token, penalty (0, or _BIG + itl over the SLO), itl_s. Read in Python per kept D.
    d_rows: FloatArray
    d_key_short: FloatArray  # pruning key without the network, for short prompts (see select)
    d_key_long: FloatArray  # ... and for prompts over local_prefill_max_tokens
    d_load: list[int]  # running + waiting, for the power-of-two choice
    p: list[DaemonView]  # available daemons that can prefill for others
    p_q: FloatArray
    p_inv: FloatArray
    colo: list[int]  # per D: index into p of its best co-located prefill daemon, -1 if none
    pool: IntArray  # indices into p
    d_pool_rtt: FloatArray  # [D, pool] RTT, 0 within a PoP


class _Prepared:
    def __init__(
        self, views: Sequence[DaemonView], geo: PopGeometry, net: NetworkModel, cfg: PlacementConfig
    ) -> None:
        self.views, self.geo, self.cfg = list(views), geo, cfg
        # Clients whose dot product with the router's PoP exceeds this are in its catchment.
        # (> 1, so nobody, when catchment_km <= 0 switches measured RTTs off.)
        self.catchment_dot = (
            math.cos(net.catchment_km / EARTH_RADIUS_KM) if net.catchment_km > 0 else 2.0
        )
        counts = Counter(v.model for v in views if v.available and v.model and v.role != "prefill")
        # Ties broken by name so every router picks the same default.
        self.default_model = min(counts, key=lambda m: (-counts[m], m)) if counts else None
        self._by_model: dict[str, _Arrays] = {}

    def arrays(self, model: str) -> _Arrays:
        return self._by_model.get(model) or self._by_model.setdefault(model, self._build(model))

    def _build(self, model: str) -> _Arrays:
        cfg, geo = self.cfg, self.geo
        mine = [v for v in self.views if v.available and v.model == model]
        d = [v for v in mine if v.role in ("decode", "both")]
        p = [v for v in mine if v.role in ("prefill", "both") and v.kv_endpoint]
        # One pass per side into a 2-D array: this runs per heartbeat (~100/s at 600 daemons).
        dm = np.asarray([
            (v.running, v.waiting, v.kv_blocks_free * v.block_size,
             v.prefill_tokens_per_s or cfg.default_prefill_tokens_per_s,
             v.decode_tokens_per_s or cfg.default_decode_tokens_per_s, v.queued_prefill_tokens,
             v.rtt_s or 0.0, v.itl_p50_s if v.itl_p50_s is not None else math.nan,
             v.role == "both", geo.index[v.pop], v.decode_tokens_per_s > 0)
            for v in d
        ], dtype=np.float64).reshape(len(d), 11)  # fmt: skip
        running, waiting, free, local_rate, d_rate, local_queued = dm[:, :6].T
        # Aggregate rate R at batch B means a step of B/R; one more sequence makes it (B+1)/R.
        p50 = np.where(np.isnan(dm[:, 7]), cfg.default_itl_s, dm[:, 7])
        d_itl = np.where((running > 0) & (dm[:, 10] > 0), (running + 1) / d_rate, p50)
        d_pop = dm[:, 9].astype(np.intp)
        pm = np.asarray([
            (v.prefill_tokens_per_s or cfg.default_prefill_tokens_per_s, v.queued_prefill_tokens,
             geo.index[v.pop])
            for v in p
        ], dtype=np.float64).reshape(len(p), 3)  # fmt: skip
        p_inv = 1.0 / pm[:, 0]
        p_q, p_pop = pm[:, 1] * p_inv, pm[:, 2].astype(np.intp)
        # Best prefill daemon of each PoP, judged on one chunk (queues differ more than speeds).
        chunk_cost = (p_q + cfg.prefill_chunk_tokens * p_inv).tolist()
        best_in_pop: dict[int, int] = {}
        for i, g in enumerate(p_pop.tolist()):
            if g not in best_in_pop or chunk_cost[i] < chunk_cost[best_in_pop[g]]:
                best_in_pop[g] = i
        colo = [best_in_pop.get(g, -1) for g in d_pop.tolist()]
        has = np.asarray([i >= 0 for i in colo], dtype=bool)
        sizes = (cfg.local_prefill_max_tokens, 8 * cfg.prefill_chunk_tokens)
        ranked = [np.argsort(p_q + n * p_inv, kind="stable")[: cfg.prefill_pool] for n in sizes]
        pool = np.unique(np.concatenate(ranked)).astype(np.intp)
        colo_q = np.where(has, p_q[colo] if p else 0.0, math.inf)
        colo_inv = np.where(has, p_inv[colo] if p else 0.0, 0.0)
        local_q, local_inv = local_queued / local_rate, 1.0 / local_rate
        limited = np.where(dm[:, 8] > 0, 0.0, math.inf)
        penalty = np.where(d_itl <= cfg.itl_slo_s, 0.0, _BIG + d_itl)
        admit_wait = (waiting + 1.0) * cfg.mean_output_tokens / d_rate
        static = penalty + np.where(waiting > 0, admit_wait, 0.0)

        def key(n: int, lim: FloatArray) -> FloatArray:
            pooled = (p_q + n * p_inv)[pool].min() if len(pool) else math.inf
            own = np.minimum(local_q + n * local_inv + lim, colo_q + n * colo_inv)
            return static + np.minimum(own, pooled)

        rows = (np.where(waiting > 0, -1.0, free), admit_wait, local_q, local_inv, limited)
        return _Arrays(
            d=d,
            d_xyz=geo.xyz[d_pop].reshape(len(d), 3),
            d_measured=dm[:, 6].copy(),
            d_rows=np.stack([*rows, colo_q, colo_inv, penalty, d_itl], axis=1),
            d_key_short=key(cfg.local_prefill_max_tokens, np.zeros(len(d))),
            d_key_long=key(4 * cfg.prefill_chunk_tokens, limited),
            d_load=(running + waiting).astype(int).tolist(),
            p=p,
            p_q=p_q,
            p_inv=p_inv,
            colo=colo,
            pool=pool,
            d_pool_rtt=geo.rtt[d_pop][:, p_pop[pool]],
        )


# One entry: routers place against the latest snapshot, so an older one is never asked again.
_snapshot: tuple[Sequence[DaemonView], NetworkModel, PlacementConfig, _Prepared] | None = None


def _prepared(views: Sequence[DaemonView], net: NetworkModel, cfg: PlacementConfig) -> _Prepared:
    global _snapshot
    s = _snapshot
    # `in` tests identity before equality, which for a dataclass builds tuples: the proxy
    # passes the same objects every time.
    if s is not None and s[0] is views and s[1] in (net,) and s[2] in (cfg,):
        return s[3]
    geo = pop_geometry({v.pop: (v.lat, v.lon) for v in views}, net)
    _snapshot = (views, net, cfg, _Prepared(views, geo, net, cfg))
    return _snapshot[3]


def select(
    views: Sequence[DaemonView],
    client: GeoPoint,
    features: RequestFeatures,
    net: NetworkModel,
    cfg: PlacementConfig,
    rng: random.Random,
    here: str,
    limit: int = 3,
    here_point: GeoPoint | None = None,
) -> list[Placement]:
    """Placements for one request, best first, one per decode daemon; [] if none can take it.
    ``here_point`` locates the router's own PoP when no daemon of it is in ``views``."""
    prep = _prepared(views, net, cfg)
    model = features.model if features.model is not None else prep.default_model
    a = prep.arrays(model) if model is not None else None
    if a is None or not a.d or limit < 1:
        return []
    prompt = max(1, features.prompt_tokens)
    lat, lon = math.radians(client.lat), math.radians(client.lon)
    xyz = (math.cos(lat) * math.cos(lon), math.cos(lat) * math.sin(lon), math.sin(lat))
    net_s = net.rtt_floor_from_dot_s(a.d_xyz @ np.array(xyz))
    h = prep.geo.xyz_of.get(here)
    if h is None and here_point is not None:
        hl, hn = math.radians(here_point.lat), math.radians(here_point.lon)
        h = (math.cos(hl) * math.cos(hn), math.cos(hl) * math.sin(hn), math.sin(hl))
    if h is not None and h[0] * xyz[0] + h[1] * xyz[1] + h[2] * xyz[2] >= prep.catchment_dot:
        net_s = np.maximum(net_s, a.d_measured)
    # Keep the D with the best network + static cost; price them exactly below.
    short = prompt <= cfg.local_prefill_max_tokens
    bound = net_s + (a.d_key_short if short else a.d_key_long)
    k = cfg.decode_candidates
    sel = np.argpartition(bound, k - 1)[:k] if len(a.d) > k else np.arange(len(a.d))
    pool_s, kv_l, best_l = [math.inf] * len(sel), [0.0] * len(sel), [0] * len(sel)
    if len(a.pool):
        pool_compute = prompt * a.p_inv[a.pool]
        # Pages of all chunks but the last stream while later chunks compute.
        kv_bytes_s = prompt * cfg.kv_bytes_per_token / net.inter_pop_bytes_per_s
        last_chunk_s = min(prompt, cfg.prefill_chunk_tokens) / prompt * kv_bytes_s
        rtt = a.d_pool_rtt[sel]
        kv = rtt + (rtt > 0) * np.maximum(kv_bytes_s - pool_compute, last_chunk_s)
        total = kv + (a.p_q[a.pool] + pool_compute)
        best = total.argmin(axis=1)
        rows = np.arange(len(sel))
        pool_s, kv_l, best_l = total[rows, best].tolist(), kv[rows, best].tolist(), best.tolist()
    # From here on: a handful of candidates, cheaper in plain Python than in numpy calls.
    sel_l, net_l, stats = sel.tolist(), net_s[sel].tolist(), a.d_rows[sel].tolist()
    need = prompt + features.max_tokens
    scored, terms_l = [], []
    for j, (free, wait, lq, linv, lim, cq, cinv, pen, itl) in enumerate(stats):
        admit = 0.0 if free >= need else wait
        local = lq + prompt * linv + (0.0 if short else lim)
        best_prefill = min(local, cq + prompt * cinv, pool_s[j])
        if best_prefill < math.inf:
            scored.append((net_l[j] + admit + pen + best_prefill, j))
        terms_l.append((admit, local, cq + prompt * cinv, best_prefill, lq, linv, itl))
    scored.sort()
    if not scored:
        return []
    order = [j for _, j in scored]
    ties = [j for score, j in scored if score <= scored[0][0] + cfg.near_tie_s]
    if len(ties) >= 2:
        # Two distinct random picks without random.sample's overhead.
        i = rng.randrange(len(ties))
        i, j = ties[i], ties[(i + 1 + rng.randrange(len(ties) - 1)) % len(ties)]
        order.remove(first := i if a.d_load[sel_l[i]] <= a.d_load[sel_l[j]] else j)
        order.insert(0, first)
    out = []
    for j in order[:limit]:
        di = sel_l[j]
        admit, local, colo, best_prefill, queue, per_token, itl = terms_l[j]
        prefill, kv_s = None, 0.0
        if local != best_prefill:
            pi = a.colo[di] if colo == best_prefill else int(a.pool[best_l[j]])
            kv_s = 0.0 if pi == a.colo[di] else kv_l[j]
            prefill, queue, per_token = a.p[pi], a.p_q.item(pi), a.p_inv.item(pi)
        terms = {"net_s": net_l[j], "admission_s": admit, "prefill_queue_s": queue,
                 "prefill_compute_s": prompt * per_token, "kv_s": kv_s}  # fmt: skip
        if prefill is not None and prefill.url == a.d[di].url:
            prefill = None  # a `both` daemon chosen as its own prefill peer is local prefill
        ttft = sum(terms.values())
        out.append(
            Placement(prefill, a.d[di], ttft, itl, itl <= cfg.itl_slo_s, terms | {"itl_s": itl})
        )
    return out
