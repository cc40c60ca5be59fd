"""Placement when the router knows which daemons hold the prompt's leading blocks.

The prefix-blind selector (:mod:`edgeinfer.router.selector`) prices a pruned set of decode
daemons against a pool of cheap prefill daemons. With prefix hits the candidates are that same
pruned set plus the daemons holding the prefix (the best holders, those within the load bound),
and the prefill side that pool plus the candidates' co-located peers plus the prefill daemons
holding the prefix; :func:`edgeinfer.router.prefix_scoring.price_pairs` prices every pair:
the prefill daemon computes only the suffix it lacks, the transfer moves only the blocks the
decode daemon lacks. The load guard (:func:`~edgeinfer.router.prefix_scoring.under_bound`)
keeps a hot prefix from making its holders a hot spot: a daemon above ``1 + load_eps`` times
the mean load is no candidate, and near-ties are broken by load as elsewhere.
"""

from __future__ import annotations

import random

import numpy as np

from edgeinfer.router.load_arrays import LoadArrays, PlacementConfig, Row
from edgeinfer.router.network import FloatArray, NetworkModel
from edgeinfer.router.placement import Placement, RequestFeatures
from edgeinfer.router.prefix_scoring import cached_tokens, price_pairs, rank


def _best(hits: list[tuple[int, float, int]], k: int) -> list[int]:
    """Indices of the ``k`` best holders: most blocks, then the nearest or least queued
    (entries are (blocks, cost, index))."""
    hits.sort(key=lambda h: (-h[0], h[1]))
    return [i for _, _, i in hits[:k]]


def select_with_prefix(
    a: LoadArrays, net: NetworkModel, net_s: FloatArray, features: RequestFeatures,
    cfg: PlacementConfig, rng: random.Random, limit: int, t: float,
) -> list[Placement]:  # fmt: skip
    """Placements best first, one per decode daemon (``features.prefix`` has hits)."""
    px = features.prefix
    if px is None:
        return []
    prompt = max(1, features.prompt_tokens)
    bs, k, kh, eps = px.block_size, cfg.decode_candidates, cfg.prefix_candidates, cfg.load_eps
    # The load guard's bounds (prefix_scoring.under_bound) as scalars: only the candidates'
    # loads are compared with them.
    load = a.load
    d_bound = (1.0 + eps) * (sum(load) + 1.0) / len(load) + 1.0
    p_queue = np.maximum(a.p_end - t, 0.0)
    job_s = prompt * a.p_inv_mean
    p_bound = (1.0 + eps) * (float(p_queue.sum()) + job_s) / len(a.p) + job_s if len(a.p) else 0.0
    # Holders within the bound, the nearest to the client (decode) or the least queued
    # (prefill) first among equal hits: a far holder loses on the network what it saves.
    d_held: list[tuple[int, float, int]] = []
    p_held: list[tuple[int, float, int]] = []
    for url, blocks in px.hits.items():
        if (i := a.d_of.get(url)) is not None and load[i] <= d_bound:
            d_held.append((blocks, net_s.item(i), i))
        if (j := a.p_of.get(url)) is not None and (q := p_queue.item(j)) <= p_bound:
            p_held.append((blocks, q, j))
    key = net_s + (a.key_short if prompt <= cfg.short_prompt_tokens else a.key_long)
    pruned = key.argpartition(k - 1)[:k].tolist() if len(a.d) > k else list(range(len(a.d)))
    sel_l = sorted(set(pruned).union(_best(d_held, kh)))
    colo = [c for i in sel_l if (c := a.colo[i]) >= 0]
    pset_l = sorted(set(a.pool_list).union(colo, _best(p_held, kh)))
    sel, pset = np.asarray(sel_l, dtype=np.intp), np.asarray(pset_l, dtype=np.intp)
    # Tokens each candidate holds: from the few holders, not by asking every candidate.
    d_cached = np.zeros(len(sel_l), dtype=np.int64)
    p_cached = np.zeros(len(pset_l), dtype=np.int64)
    d_pos = {i: n for n, i in enumerate(sel_l)}
    p_pos = {j: n for n, j in enumerate(pset_l)}
    for url, blocks in px.hits.items():
        tokens = cached_tokens(prompt, blocks, bs)
        if (n := d_pos.get(a.d_of.get(url, -1))) is not None:
            d_cached[n] = tokens
        if (n := p_pos.get(a.p_of.get(url, -1))) is not None:
            p_cached[n] = tokens
    d_load = [load[i] for i in sel_l]
    d_ok = np.asarray([x <= d_bound for x in d_load], dtype=bool)
    p_ok = p_queue[pset] <= p_bound
    rows = np.asarray([a.d_rows[i] for i in sel_l], dtype=np.float64).reshape(len(sel), -1)
    free, wait = rows[:, Row.FREE_TOKENS], rows[:, Row.ADMIT_WAIT_S]
    admit = np.where(free >= prompt + features.max_tokens, 0.0, wait)
    prices = price_pairs(
        net, prompt, a.kv_bytes_per_token, a.chunk_tokens,
        net_s[sel] + admit + rows[:, Row.PENALTY], d_cached,
        np.maximum(rows[:, Row.LOCAL_END] - t, 0.0), rows[:, Row.LOCAL_S_PER_TOKEN],
        prompt - d_cached <= rows[:, Row.LOCAL_MAX_TOKENS],
        p_cached, p_queue[pset], a.p_inv[pset], p_ok,
        a.geo.rtt[a.d_pop[sel]][:, a.p_pop[pset]], cfg.work_weight,
    )  # fmt: skip
    # What a placement on each D reuses: the prefill not computed, and the pages D need not
    # receive (a D prefilling its own cached prefix reuses it twice over).
    saved = prompt - prices.computed_tokens + d_cached
    d_load_arr = np.asarray(d_load, dtype=np.float64)
    order = rank(prices.score_s, d_load_arr, d_ok, cfg.near_tie_s, rng, limit, saved)
    if not order:  # every candidate above the bound: the least bad of them all the same
        allowed = np.ones(len(sel), dtype=bool)
        order = rank(prices.score_s, d_load_arr, allowed, cfg.near_tie_s, rng, limit, saved)
    out = []
    for j in order:
        d = a.d[sel_l[j]]
        pi = int(prices.prefill[j])
        prefill = a.p[int(pset[pi])] if pi >= 0 else None
        if prefill is not None and prefill.url == d.url:
            prefill = None  # a `both` daemon chosen as its own prefill peer is local prefill
        itl = float(rows[j, Row.ITL_S])
        terms = {
            "net_s": float(net_s[sel_l[j]]), "admission_s": float(admit[j]),
            "prefill_queue_s": float(prices.queue_s[j]), "prefill_compute_s": float(prices.compute_s[j]),
            "kv_s": float(prices.kv_s[j]), "itl_s": itl,
        }  # fmt: skip
        ttft = (
            terms["net_s"] + terms["admission_s"] + terms["prefill_queue_s"]
            + terms["prefill_compute_s"] + terms["kv_s"]
        )  # fmt: skip
        computed = int(prices.computed_tokens[j])
        out.append(Placement(
            prefill, d, ttft, itl, itl <= cfg.itl_slo_s, terms,
            prefill_cached=prompt - computed, decode_cached=int(d_cached[j]),
            computed_tokens=computed,
        ))  # fmt: skip
    return out
