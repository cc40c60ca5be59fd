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
the same list object until something changes; PoP geometry is kept until a reload); a decision
then costs about twenty numpy calls: a TTFT lower bound for every D, the ``decode_candidates``
best kept, and their exact costs against a small prefill pool in one small matrix.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from edgeinfer.router.geo import GeoPoint
from edgeinfer.router.network import (
    EARTH_RADIUS_KM,
    FloatArray,
    IntArray,
    NetworkModel,
    unit_vectors,
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
    """Per-snapshot, per-model inputs of the cost model.

    ``d_*``: one entry per available decode-capable daemon. Remote prefill is priced against a
    small set: per decode daemon its best *co-located* prefill daemon (no transfer), plus a pool
    of the prefill daemons with the shortest queue-plus-compute for a short and for a long
    prompt. A far prefill daemon that is neither cheap nor near can only lose: its pages must
    still cross the network.
    """

    d: list[DaemonView]
    d_xyz: FloatArray
    d_measured: FloatArray  # router's RTT EWMA to the daemon's PoP, 0 when unmeasured
    d_free_tokens: FloatArray  # room for a request now; -1 when requests are already waiting
    d_admit_wait: FloatArray  # seconds until a slot frees when there is no room
    d_local_q: FloatArray  # own prefill queue, seconds
    d_local_inv: FloatArray  # seconds per prompt token when prefilling locally
    d_local_limited: FloatArray  # inf where only short prompts may prefill locally
    d_itl: FloatArray
    d_penalty: FloatArray  # 0, or _BIG + itl over the SLO
    d_load: list[int]  # running + waiting, for the power-of-two choice
    d_pop: IntArray  # index into the PoP geometry
    p: list[DaemonView]  # available daemons that can prefill for others
    p_q: FloatArray
    p_inv: FloatArray
    p_pop: IntArray
    colo: list[int]  # per D: index into p of its best co-located prefill daemon, -1 if none
    colo_q: FloatArray  # that daemon's queue seconds (inf if none) ...
    colo_inv: FloatArray  # ... and seconds per token (0 if none)
    pool: IntArray  # indices into p
    d_pool_rtt: FloatArray  # [D, pool] RTT, 0 within a PoP


class _Geometry:
    """PoP positions and the PoP-to-PoP RTT matrix; only a reload changes them."""

    def __init__(self, pops: dict[str, tuple[float, float]], net: NetworkModel) -> None:
        self.index = {name: i for i, name in enumerate(pops)}
        lat_lon = np.asarray(list(pops.values()), dtype=np.float64).reshape(len(pops), 2)
        self.xyz: FloatArray = unit_vectors(lat_lon[:, 0], lat_lon[:, 1])
        rtt = np.asarray(net.rtt_floor_from_dot_s(self.xyz @ self.xyz.T))
        np.fill_diagonal(rtt, 0.0)  # inside a PoP: no transfer cost, as NetworkModel says
        self.rtt: FloatArray = rtt


class _Prepared:
    def __init__(self, views: Sequence[DaemonView], geo: _Geometry, cfg: PlacementConfig):
        self.views, self.geo, self.cfg = list(views), geo, cfg
        serving = [v for v in views if v.available and v.model and v.role != "prefill"]
        counts = Counter(v.model for v in serving)
        # Ties broken by name so every router picks the same default.
        self.default_model = min(counts, key=lambda m: (-counts[m], m)) if counts else None
        self._by_model: dict[str, _Arrays] = {}

    def arrays(self, model: str) -> _Arrays:
        if model not in self._by_model:
            self._by_model[model] = self._build(model)
        return self._by_model[model]

    def _build(self, model: str) -> _Arrays:
        cfg, geo = self.cfg, self.geo
        mine = [v for v in self.views if v.available and v.model == model]
        d = [v for v in mine if v.role in ("decode", "both")]
        p = [v for v in mine if v.role in ("prefill", "both") and v.kv_endpoint]
        # One pass per side into a 2-D array, then column arithmetic: a snapshot is rebuilt on
        # every heartbeat, so this runs ~100 times a second at 600 daemons.
        nan = math.nan
        dm = _table(
            d,
            lambda v: (
                v.running,
                v.waiting,
                v.kv_blocks_free * v.block_size,
                v.prefill_tokens_per_s or cfg.default_prefill_tokens_per_s,
                v.decode_tokens_per_s or cfg.default_decode_tokens_per_s,
                v.queued_prefill_tokens,
                v.rtt_s or 0.0,
                v.itl_p50_s if v.itl_p50_s is not None else nan,
                v.role == "both",
                geo.index[v.pop],
            ),
            10,
        )
        running, waiting, free, local_rate, d_rate, local_queued = dm[:, :6].T
        # Aggregate rate R at batch B means a step of B/R; one more sequence makes it (B+1)/R.
        p50 = np.where(np.isnan(dm[:, 7]), cfg.default_itl_s, dm[:, 7])
        measured = np.asarray([v.decode_tokens_per_s > 0 for v in d], dtype=bool)
        d_itl = np.where((running > 0) & measured, (running + 1) / d_rate, p50)
        d_pop = dm[:, 9].astype(np.intp)
        pm = _table(
            p,
            lambda v: (
                v.prefill_tokens_per_s or cfg.default_prefill_tokens_per_s,
                v.queued_prefill_tokens,
                geo.index[v.pop],
            ),
            3,
        )
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
        return _Arrays(
            d=d,
            d_xyz=geo.xyz[d_pop].reshape(len(d), 3),
            d_measured=dm[:, 6].copy(),
            d_free_tokens=np.where(waiting > 0, -1.0, free),
            d_admit_wait=(waiting + 1.0) * cfg.mean_output_tokens / d_rate,
            d_local_q=local_queued / local_rate,
            d_local_inv=1.0 / local_rate,
            d_local_limited=np.where(dm[:, 8] > 0, 0.0, math.inf),
            d_itl=d_itl,
            d_penalty=np.where(d_itl <= cfg.itl_slo_s, 0.0, _BIG + d_itl),
            d_load=(running + waiting).astype(int).tolist(),
            d_pop=d_pop,
            p=p,
            p_q=p_q,
            p_inv=p_inv,
            p_pop=p_pop,
            colo=colo,
            colo_q=np.where(has, p_q[colo] if p else 0.0, math.inf),
            colo_inv=np.where(has, p_inv[colo] if p else 0.0, 0.0),
            pool=pool,
            d_pool_rtt=geo.rtt[d_pop][:, p_pop[pool]],
        )


def _table(
    views: list[DaemonView], row: Callable[[DaemonView], tuple[float, ...]], width: int
) -> FloatArray:
    return np.asarray([row(v) for v in views], dtype=np.float64).reshape(len(views), width)


# One entry each: routers place against the latest snapshot, so an older one is never asked
# again; the geometry outlives snapshots (only a reload of the PoP table changes it).
_geometry: tuple[dict[str, tuple[float, float]], NetworkModel, _Geometry] | None = None
_snapshot: tuple[Sequence[DaemonView], NetworkModel, PlacementConfig, _Prepared] | None = None


def _prepared(views: Sequence[DaemonView], net: NetworkModel, cfg: PlacementConfig) -> _Prepared:
    global _geometry, _snapshot
    s = _snapshot
    if (
        s is not None
        and s[0] is views
        and (s[1] is net or s[1] == net)
        and (s[2] is cfg or s[2] == cfg)
    ):
        return s[3]
    pops = {v.pop: (v.lat, v.lon) for v in views}
    if _geometry is None or _geometry[0] != pops or _geometry[1] != net:
        _geometry = (pops, net, _Geometry(pops, net))
    prepared = _Prepared(views, _geometry[2], cfg)
    _snapshot = (views, net, cfg, prepared)
    return prepared


def select(
    views: Sequence[DaemonView],
    client: GeoPoint,
    features: RequestFeatures,
    net: NetworkModel,
    cfg: PlacementConfig,
    rng: random.Random,
    here: str,
    limit: int = 3,
) -> list[Placement]:
    """Placements for one request, best first, one per decode daemon; [] if none can take it."""
    prep = _prepared(views, net, cfg)
    model = features.model if features.model is not None else prep.default_model
    if model is None or limit < 1:
        return []
    a = prep.arrays(model)
    if not a.d:
        return []
    prompt = max(1, features.prompt_tokens)
    lat, lon = math.radians(client.lat), math.radians(client.lon)
    c = np.array((math.cos(lat) * math.cos(lon), math.cos(lat) * math.sin(lon), math.sin(lat)))
    net_s = net.rtt_floor_from_dot_s(a.d_xyz @ c)
    here_i = prep.geo.index.get(here)
    if here_i is not None and prep.geo.xyz[here_i] @ c >= math.cos(
        net.catchment_km / EARTH_RADIUS_KM
    ):
        net_s = np.maximum(net_s, a.d_measured)
    admit = np.where(a.d_free_tokens >= prompt + features.max_tokens, 0.0, a.d_admit_wait)
    local = a.d_local_q + prompt * a.d_local_inv
    if prompt > cfg.local_prefill_max_tokens:
        local += a.d_local_limited
    colo = a.colo_q + prompt * a.colo_inv
    pool_compute = prompt * a.p_inv[a.pool]
    pool_cost = a.p_q[a.pool] + pool_compute
    base = net_s + admit + a.d_penalty
    # Lower bound of each D's TTFT: a pool daemon at no transfer cost.
    own = np.minimum(local, colo)
    bound = base + (np.minimum(own, pool_cost.min()) if len(a.pool) else own)
    k = cfg.decode_candidates
    sel = np.argpartition(bound, k - 1)[:k] if len(a.d) > k else np.arange(len(a.d))
    if len(a.pool):
        # Pages of all chunks but the last stream while later chunks compute.
        kv_bytes_s = prompt * cfg.kv_bytes_per_token / net.inter_pop_bytes_per_s
        last_chunk_s = min(prompt, cfg.prefill_chunk_tokens) / prompt * kv_bytes_s
        exposed = np.maximum(kv_bytes_s - pool_compute, last_chunk_s)
        rtt = a.d_pool_rtt[sel]
        kv = rtt + (rtt > 0) * exposed
        total = kv + pool_cost
        best_pool = total.argmin(axis=1)
        pool_s = total[np.arange(len(sel)), best_pool].tolist()
        kv_l = kv[np.arange(len(sel)), best_pool].tolist()
        best_pool_l = best_pool.tolist()
    else:
        pool_s = kv_l = [math.inf] * len(sel)
        best_pool_l = [0] * len(sel)
    # From here on: a handful of candidates, cheaper in plain Python than in numpy calls.
    sel_l, base_l = sel.tolist(), base[sel].tolist()
    local_l, colo_l = local[sel].tolist(), colo[sel].tolist()
    scored = []
    for j in range(len(sel_l)):
        best = min(local_l[j], colo_l[j], pool_s[j])
        if best < math.inf:
            scored.append((base_l[j] + best, j))
    if not scored:
        return []
    scored.sort()
    order = [j for _, j in scored]
    ties = [j for score, j in scored if score <= scored[0][0] + cfg.near_tie_s]
    if len(ties) >= 2:
        i, j = rng.sample(ties, 2)
        first = i if a.d_load[sel_l[i]] <= a.d_load[sel_l[j]] else j
        order.remove(first)
        order.insert(0, first)
    out = []
    for j in order[:limit]:
        di = sel_l[j]
        if local_l[j] <= min(colo_l[j], pool_s[j]):
            prefill, queue, per_token, kv_s = None, a.d_local_q[di], a.d_local_inv[di], 0.0
        else:
            pi = a.colo[di] if colo_l[j] <= pool_s[j] else int(a.pool[best_pool_l[j]])
            kv_s = 0.0 if pi == a.colo[di] else kv_l[j]
            prefill, queue, per_token = a.p[pi], a.p_q[pi], a.p_inv[pi]
        terms = {
            "net_s": float(net_s[di]),
            "admission_s": float(admit[di]),
            "prefill_queue_s": float(queue),
            "prefill_compute_s": float(prompt * per_token),
            "kv_s": kv_s,
        }
        itl = float(a.d_itl[di])
        out.append(
            Placement(
                prefill=None if prefill is not None and prefill.url == a.d[di].url else prefill,
                decode=a.d[di],
                ttft_s=sum(terms.values()),
                itl_s=itl,
                meets_slo=itl <= cfg.itl_slo_s,
                breakdown={**terms, "itl_s": itl},
            )
        )
    return out
