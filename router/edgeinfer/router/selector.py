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
reference prompt), keeps the ``decode_candidates`` best and prices those exactly, all in one
compiled pass (:mod:`edgeinfer.router.candidate_cut`); the near-tie draw and the placements
are plain Python.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Sequence

from edgeinfer.router import candidate_cut, load_update, prefix_select
from edgeinfer.router.candidate_cut import (
    ITL,
    KEY_LONG,
    KEY_SHORT,
    ROW,
    SCORE,
    ClientRtt,
    price_candidates,
    unit_vector,
)  # fmt: skip
from edgeinfer.router.geo import GeoPoint
from edgeinfer.router.inflight import PlacementLedger, Ticket
from edgeinfer.router.load_arrays import LoadArrays
from edgeinfer.router.network import NetworkModel
from edgeinfer.router.placement import Placement, PlacementConfig, PrefixHits, RequestFeatures
from edgeinfer.router.pop_registry import DaemonView
from edgeinfer.router.prefix_select import select_with_prefix
from edgeinfer.router.prepared import Prepared, prepared

__all__ = [
    "Placement", "PlacementConfig", "PrefixHits", "RequestFeatures", "record_placement", "select",
    "warm",
]  # fmt: skip


def warm() -> None:
    """Compile (or load from the disk cache) the decision's passes and the per-placement
    updates, so that no request waits for the compiler (seconds)."""
    candidate_cut.warm()
    load_update.warm()
    prefix_select.warm()  # and the pair search it calls


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
    rtt = _client_rtt(prep, a, net, client, here, here_point)
    px = features.prefix
    if px is not None and (px.hits or px.lookup is not None):
        # None: no candidate holds the prefix; []: no pair of them within the load guard can
        # place it (their queues grew since the pool was chosen). Either way the path below
        # decides, pricing the whole pool: a request is never refused for its cache's sake.
        placed = select_with_prefix(a, net, rtt, features, cfg, rng, limit, t)
        if placed:
            return placed
    prompt = max(1, features.prompt_tokens)
    short = prompt <= cfg.short_prompt_tokens
    key = KEY_SHORT if short else KEY_LONG
    # The session's daemon, when the client names a session and the prompt's cache is unknown:
    # in the PoP placement prefers (affinity is within a location, not across the world).
    sticky = None
    if features.affinity and features.prefix is None:
        home = a.d_pop_list[rtt.cheapest(key, 1)[0].item(0)]
        sticky = a.affinity_pick(features.affinity, home, cfg.load_eps)
    # The D with the best network + static cost priced exactly, in one compiled pass.
    cx, cy, cz = rtt.point
    priced = price_candidates(
        a.d_state, key, a.pool_state, a.d_pool_rtt, cx, cy, cz, rtt.scale, rtt.fixed,
        rtt.use_measured, cfg.decode_candidates, -1 if sticky is None else sticky,
        net.kv_link_s(prompt * a.kv_bytes_per_token), float(cfg.prefill_chunk_tokens),
        float(prompt), float(prompt + features.max_tokens), t,
    ).tolist()  # fmt: skip
    # From here on: a handful of candidates, cheaper in plain Python than in numpy calls.
    n = bisect.bisect_left(priced, [math.inf])  # by score: those that can prefill come first
    if not n:
        return []
    best = priced[0][SCORE]
    ties = bisect.bisect_right(priced, [best + cfg.near_tie_s, math.inf], hi=n)
    # First: the session's daemon when it can place, within the ITL SLO and near the best;
    # else, among near-ties, the less loaded of two drawn at random; else the best.
    lead = None
    if sticky is not None:
        lead = next((j for j in range(n) if priced[j][ROW] == sticky), None)
    if lead is not None and not (
        priced[lead][ITL] <= cfg.itl_slo_s and priced[lead][SCORE] <= best + cfg.affinity_slack_s
    ):
        lead = None
    if lead is None and ties >= 2:
        # Two distinct random picks without random.sample's overhead.
        i = rng.randrange(ties)
        j = (i + 1 + rng.randrange(ties - 1)) % ties
        lead = i if a.load[int(priced[i][ROW])] <= a.load[int(priced[j][ROW])] else j
    order = list(range(n))
    if lead is not None:
        order.remove(lead)
        order.insert(0, lead)
    out = []
    for j in order[:limit]:
        (_, row, net_s, admit, local, colo, best_prefill, queue, per_token, itl, member,
         kv) = priced[j]  # fmt: skip
        di = int(row)
        prefill, kv_s = None, 0.0
        if local != best_prefill:
            if colo == best_prefill:
                pi = a.colo[di]
            else:
                pi = a.pool_list[int(member)]
                kv_s = kv
            prefill, per_token = a.p[pi], a.p_inv_l[pi]
            queue = max(float(a.p_end[pi]) - t, 0.0)
            if prefill.url == a.d[di].url:
                prefill = None  # a `both` daemon chosen as its own prefill peer is local prefill
        compute = prompt * per_token
        ttft = net_s + admit + queue + compute + kv_s
        terms = {"net_s": net_s, "admission_s": admit, "prefill_queue_s": queue,
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


def _client_rtt(
    prep: Prepared, a: LoadArrays, net: NetworkModel, client: GeoPoint, here: str,
    here_point: GeoPoint | None,
) -> ClientRtt:  # fmt: skip
    """RTTs from the client to the decode daemons: the great-circle floor, or inside the
    router's own catchment the RTT it measured to the daemon's PoP when that is larger."""
    h = prep.geo.xyz_of.get(here)
    if h is None and here_point is not None:
        h = unit_vector(here_point.lat, here_point.lon)
    xyz = unit_vector(client.lat, client.lon)
    inside = h is not None and h[0] * xyz[0] + h[1] * xyz[1] + h[2] * xyz[2] >= prep.catchment_dot
    return ClientRtt(a.d_state, xyz, net, inside)
