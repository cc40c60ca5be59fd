"""Placement policy: which prefill daemon P and decode daemon D serve a request. Pure, no I/O.

The request path is client -> router -> D; D asks P for the prompt's KV (``x-edge-prefill``), P
pushes the pages to D, D streams tokens back. So, per candidate:

    TTFT = RTT(client, D)                      request in, first token out
         + admission at D                      0 if D has room now, else its queue drains
         + prefill queue at P + compute at P   queued tokens and this prompt at P's rate
         + KV transfer P -> D                  RTT(P, D) + pages not hidden behind compute
    ITL  = (running + 1) / decode rate of D    (else its measured median, else a default)

Load is what the heartbeats report plus what this router has placed since and they cannot show
yet (``pending``, :mod:`edgeinfer.router.inflight`; the caller records each placement it sends
with :func:`record_placement`): without it every decision between two heartbeats prices the
same picture and the next seconds of traffic herd onto the same few cheapest daemons.

"Local" prefill (P = D) skips the transfer; a ``both`` daemon may always do it, a ``decode`` one
only for prompts up to its own ``local_prefill_threshold`` (its heartbeats carry it, and its KV
bytes per token). Request bytes are left out: ~5 bytes per prompt token against ~100 KB of KV,
and the same for every candidate.

Prefix hits (``features.prefix``: which daemons hold the prompt's leading blocks) switch to
:mod:`edgeinfer.router.prefix_select`, which prices the uncached suffix and the blocks the
decode daemon lacks (when none of its candidates holds a block, the path below decides).
Without prefix knowledge, a session-affinity hint (``features.affinity``,
:mod:`edgeinfer.router.session_affinity`) puts the session's daemon (of the PoP placement
prefers) first when it is within the load bound, the ITL SLO and ``affinity_slack_s`` of the
best.

Rank: candidates meeting the ITL SLO by TTFT; if none does, the least bad (ITL + TTFT). Among
candidates within ``near_tie_s`` of the best, two are drawn at random and the less loaded wins
(power of two choices), so routers reading the same heartbeats do not herd onto one daemon. The
answer has one placement per decode daemon, best first, so the proxy's retries go elsewhere.

Speed: arrays of every daemon's load are built once per registry snapshot (the registry returns
the same list object until something changes; PoP geometry is kept until a reload) and updated
row by row per placement (:mod:`edgeinfer.router.load_arrays`). A decision
ranks every D by network RTT plus a static key (SLO penalty, admission, cheapest prefill for a
reference prompt), keeps the ``decode_candidates`` best and prices those exactly: the prefill
pool in one small numpy matrix, the rest in plain Python.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Sequence

import numpy as np

from edgeinfer.router.geo import GeoPoint
from edgeinfer.router.inflight import PlacementLedger, Ticket
from edgeinfer.router.load_arrays import LoadArrays
from edgeinfer.router.network import FloatArray, NetworkModel
from edgeinfer.router.placement import Placement, PlacementConfig, PrefixHits, RequestFeatures
from edgeinfer.router.pop_registry import DaemonView
from edgeinfer.router.prefix_select import select_with_prefix
from edgeinfer.router.prepared import Prepared, prepared

__all__ = [
    "Placement", "PlacementConfig", "PrefixHits", "RequestFeatures", "record_placement", "select",
]  # fmt: skip


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
    pending: PlacementLedger | None = None,
    now: float | None = None,
) -> list[Placement]:
    """Placements for one request, best first, one per decode daemon; [] if none can take it.
    ``here_point`` locates the router's own PoP when no daemon of it is in ``views``;
    ``pending`` holds what this router placed since the heartbeats (added to their load);
    ``now`` (the registry's clock) lets prefill queues drain since they were reported."""
    prep = prepared(views, net, cfg, pending)
    model = features.model if features.model is not None else prep.default_model
    a = prep.arrays(model, now) if model is not None else None
    if a is None or not a.d or limit < 1:
        return []
    t = now if now is not None else 0.0  # queues are end times on this clock (load_arrays)
    net_s = _net_to_client(prep, a, net, client, here, here_point)
    px = features.prefix
    if px is not None and (px.hits or px.lookup is not None):
        # None: no candidate holds the prefix; []: no pair of them within the load guard can
        # place it (their queues grew since the pool was chosen). Either way the path below
        # decides, pricing the whole pool: a request is never refused for its cache's sake.
        placed = select_with_prefix(a, net, net_s, features, cfg, rng, limit, t)
        if placed:
            return placed
    prompt = max(1, features.prompt_tokens)
    # Keep the D with the best network + static cost; price them exactly below.
    short = prompt <= cfg.short_prompt_tokens
    k = cfg.decode_candidates
    cost = net_s + (a.key_short if short else a.key_long)
    sel = cost.argpartition(k - 1)[:k] if len(a.d) > k else np.arange(len(a.d))
    # The session's daemon, when the client names a session and the prompt's cache is unknown:
    # in the PoP placement prefers (affinity is within a location, not across the world).
    sticky = None
    if features.affinity and features.prefix is None:
        home = int(a.d_pop[sel[cost[sel].argmin()]])
        sticky = a.affinity_pick(features.affinity, home, cfg.load_eps)
        if sticky is not None and sticky not in sel:
            sel = np.append(sel, sticky)
    n = len(sel)
    pool_s, best_l, xfer = [math.inf] * n, [0] * n, None
    if len(a.pool):
        pool_compute = prompt * a.pool_inv  # [pool]
        # Pages of all chunks but the last stream while later chunks compute.
        link_s = net.kv_link_s(prompt * a.kv_bytes_per_token)
        xfer = net.kv_exposed_s(link_s, pool_compute, prompt, cfg.prefill_chunk_tokens)  # far
        ready = np.maximum(a.pool_end - t, 0.0)
        ready += pool_compute
        total = a.d_pool_far[sel] * xfer  # [n, pool]: RTT + transfer + queue + compute
        total += a.d_pool_rtt[sel]
        total += ready
        best = total.argmin(axis=1)
        pool_s, best_l = total.min(axis=1).tolist(), best.tolist()
    # From here on: a handful of candidates, cheaper in plain Python than in numpy calls.
    sel_l, net_l = sel.tolist(), net_s[sel].tolist()
    d_rows = a.d_rows
    need = prompt + features.max_tokens
    scored, terms_l = [], []
    # Conditional expressions rather than max()/min() calls: this loop is the hot spot.
    for j, di in enumerate(sel_l):
        free, wait, l_end, linv, lmax, c_end, cinv, pen, itl = d_rows[di]
        lq = l_end - t if l_end > t else 0.0
        local = lq + prompt * linv if prompt <= lmax else math.inf
        colo = (c_end - t if c_end > t else 0.0) + prompt * cinv
        best_prefill = local if local <= colo else colo
        if pool_s[j] < best_prefill:
            best_prefill = pool_s[j]
        admit = 0.0 if free >= need else wait
        if best_prefill < math.inf:
            scored.append((net_l[j] + admit + pen + best_prefill, j))
        terms_l.append((admit, local, colo, best_prefill, lq, linv, itl))
    if not scored:
        return []
    scored.sort()
    order = [j for _, j in scored]
    # Sorted, so the near-ties are a prefix.
    ties = order[: bisect.bisect_right(scored, (scored[0][0] + cfg.near_tie_s, math.inf))]
    within = scored[0][0] + cfg.affinity_slack_s
    if (
        sticky is not None
        and (j := sel_l.index(sticky)) in order
        and terms_l[j][-1] <= cfg.itl_slo_s
        and any(score <= within for score, jj in scored if jj == j)
    ):
        order.remove(j)
        order.insert(0, j)
    elif len(ties) >= 2:
        # Two distinct random picks without random.sample's overhead.
        i = rng.randrange(len(ties))
        i, j = ties[i], ties[(i + 1 + rng.randrange(len(ties) - 1)) % len(ties)]
        order.remove(first := i if a.load[sel_l[i]] <= a.load[sel_l[j]] else j)
        order.insert(0, first)
    out = []
    for j in order[:limit]:
        di = sel_l[j]
        admit, local, colo, best_prefill, queue, per_token, itl = terms_l[j]
        prefill, kv_s = None, 0.0
        if local != best_prefill:
            if colo == best_prefill:
                pi = a.colo[di]
            else:
                pi = int(a.pool[best_l[j]])
                rtt = a.d_pool_rtt.item(di, best_l[j])
                kv_s = rtt + xfer.item(best_l[j]) if rtt > 0 and xfer is not None else 0.0
            prefill, per_token = a.p[pi], a.p_inv.item(pi)
            queue = max(a.p_end.item(pi) - t, 0.0)
            if prefill.url == a.d[di].url:
                prefill = None  # a `both` daemon chosen as its own prefill peer is local prefill
        compute = prompt * per_token
        ttft = net_l[j] + admit + queue + compute + kv_s
        terms = {"net_s": net_l[j], "admission_s": admit, "prefill_queue_s": queue,
                 "prefill_compute_s": compute, "kv_s": kv_s, "itl_s": itl}  # fmt: skip
        out.append(Placement(prefill, a.d[di], ttft, itl, itl <= cfg.itl_slo_s, terms))
    return out


def record_placement(
    pending: PlacementLedger, placement: Placement, features: RequestFeatures, now: float
) -> Ticket:
    """Tell ``pending`` that ``placement`` was sent (cancel the ticket if it never got there).
    How long until a heartbeat can show it: the client's RTT to D stands for the request's way
    there and the heartbeat's way back (the router is near the client); P hears of it once D
    has admitted it and sent the prefill request, and ``kv_s`` holds that hop (with the pages'
    own time, so it errs long: a placement counted a little longer, not lost)."""
    b = placement.breakdown
    decode_lag = b["net_s"]
    prefill = placement.prefill.url if placement.prefill is not None else None
    computed = placement.computed_tokens
    return pending.record(
        now, placement.decode.url, prefill,
        computed if computed is not None else features.prompt_tokens,
        features.prompt_tokens + features.max_tokens, decode_lag,
        decode_lag + b["admission_s"] + b["kv_s"], b["prefill_compute_s"],
    )  # fmt: skip


def _net_to_client(
    prep: Prepared, a: LoadArrays, net: NetworkModel, client: GeoPoint, here: str,
    here_point: GeoPoint | None,
) -> FloatArray:  # fmt: skip
    """RTT from the client to every D: the great-circle floor, or inside the router's own
    catchment the RTT it measured to the daemon's PoP when that is larger."""
    lat, lon = math.radians(client.lat), math.radians(client.lon)
    xyz = (math.cos(lat) * math.cos(lon), math.cos(lat) * math.sin(lon), math.sin(lat))
    net_s = net.rtt_floor_to_point_s(a.d_xyz, xyz)
    h = prep.geo.xyz_of.get(here)
    if h is None and here_point is not None:
        hl, hn = math.radians(here_point.lat), math.radians(here_point.lon)
        h = (math.cos(hl) * math.cos(hn), math.cos(hl) * math.sin(hn), math.sin(hl))
    if h is not None and h[0] * xyz[0] + h[1] * xyz[1] + h[2] * xyz[2] >= prep.catchment_dot:
        net_s = np.maximum(net_s, a.d_measured)
    return net_s
