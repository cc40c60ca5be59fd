"""Placement when the router knows which daemons hold the prompt's leading blocks.

The prefix-blind selector (:mod:`edgeinfer.router.selector`) prices a pruned set of decode
daemons against a pool of cheap prefill daemons. With prefix hits the candidates are that same
pruned set plus the daemons holding the prefix (the best holders, those within the load bound),
and the prefill side that pool plus the candidates' co-located peers plus the prefill daemons
holding the prefix. Each pair is priced as :func:`edgeinfer.router.prefix_scoring.price_pairs`
does (the prefill daemon computes only the suffix it lacks, the transfer moves only the blocks
the decode daemon lacks), but only the pairs that can place the request
(:mod:`edgeinfer.router.prefix_pairs`: bounds by RTT, transfer and load first). The load guard
(:func:`~edgeinfer.router.prefix_scoring.under_bound`) keeps a hot prefix from making its
holders a hot spot: a daemon above ``1 + load_eps`` times the mean load is no candidate, and
near-ties are broken by load as elsewhere. Candidates above the bound are left out before
pricing (a prefill daemon there pairs with none; a decode daemon there is priced only when none
within it can place, as ``rank`` falls back), so the choice is the one pricing them all gives.

The prefix index is asked about candidates only (``PrefixHits.lookup``): the
``prefix_lookup_candidates`` best decode daemons by network and static cost (a wider cut than
the priced one, so a conversation's daemon is found while it is not among the very cheapest),
their co-located prefill peers and the prefill pool. None of them holding a block, the request
is placed as without prefix knowledge.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np

from edgeinfer.router.candidate_cut import KEY_LONG, KEY_SHORT, ClientRtt
from edgeinfer.router.load_arrays import LoadArrays
from edgeinfer.router.load_columns import Row
from edgeinfer.router.network import NetworkModel
from edgeinfer.router.placement import Placement, PlacementConfig, RequestFeatures
from edgeinfer.router.prefix_pairs import Candidates, choose
from edgeinfer.router.prefix_scoring import cached_tokens

# Row's fields as plain ints: an IntEnum member costs an attribute lookup per use.
_FREE, _WAIT, _L_END = int(Row.FREE_TOKENS), int(Row.ADMIT_WAIT_S), int(Row.LOCAL_END)
_L_SPT, _L_MAX, _PENALTY = int(Row.LOCAL_S_PER_TOKEN), int(Row.LOCAL_MAX_TOKENS), int(Row.PENALTY)
_ITL = int(Row.ITL_S)


def _best(hits: list[tuple[int, float, int]], k: int) -> list[int]:
    """Indices of the ``k`` best holders: most blocks, then the nearest or least queued
    (entries are (blocks, cost, index))."""
    hits.sort(key=lambda h: (-h[0], h[1]))
    return [i for _, _, i in hits[:k]]


def select_with_prefix(
    a: LoadArrays, net: NetworkModel, rtt: ClientRtt, features: RequestFeatures,
    cfg: PlacementConfig, rng: random.Random, limit: int, t: float,
) -> list[Placement] | None:  # fmt: skip
    """Placements best first, one per decode daemon; None when no candidate holds any of the
    prompt's blocks (the prefix-blind path decides)."""
    px = features.prefix
    if px is None:
        return None
    prompt = max(1, features.prompt_tokens)
    k, eps = cfg.decode_candidates, cfg.load_eps
    key = KEY_SHORT if prompt <= cfg.short_prompt_tokens else KEY_LONG
    # The load guard's bounds (prefix_scoring.under_bound) as scalars: only the candidates'
    # loads are compared with them.
    load, p_end = a.load, a.p_end
    d_bound = (1.0 + eps) * (a.load_sum + 1.0) / len(load) + 1.0
    job_s = prompt * a.p_inv_mean
    p_bound = (
        (1.0 + eps) * (float(np.maximum(a.p_end - t, 0.0).sum()) + job_s) / len(a.p) + job_s
        if len(a.p)
        else 0.0
    )
    hits = px.hits
    if px.lookup is not None:
        # The index is asked about the candidates only: the pruned decode daemons of a wider
        # cut, their co-located prefill peers and the prefill pool.
        wide_l = rtt.cheapest(key, max(cfg.prefix_lookup_candidates, k))[0].tolist()
        ask = {a.d[i].url for i in wide_l}
        ask.update(a.p[j].url for j in a.pool_list)
        ask.update(a.p[c].url for i in wide_l if (c := a.colo[i]) >= 0)
        hits = px.lookup(ask)
        pruned = wide_l[:k]  # the wide cut is cheapest first
    else:
        pruned = rtt.cheapest(key, k)[0].tolist()
    if not hits:
        return None
    kh = cfg.prefix_candidates
    # Holders within the bound, the nearest to the client (decode) or the least queued
    # (prefill) first among equal hits: a far holder loses on the network what it saves.
    d_held: list[tuple[int, float, int]] = []
    p_held: list[tuple[int, float, int]] = []
    d_of, p_of = a.d_of, a.p_of
    for url, blocks in hits.items():
        if (i := d_of.get(url)) is not None and load[i] <= d_bound:
            d_held.append((blocks, rtt(i), i))
        if (j := p_of.get(url)) is not None:
            q = float(p_end[j]) - t
            if q <= p_bound:  # (a negative queue is an idle daemon: within the bound)
                p_held.append((blocks, q if q > 0.0 else 0.0, j))
    sel_l = sorted(set(pruned).union(_best(d_held, kh)))
    colo = [c for i in sel_l if (c := a.colo[i]) >= 0]
    # Prefill daemons above the bound pair with no decode daemon: left out before pricing.
    pset_l, p_queue = [], []
    for j in sorted(set(a.pool_list).union(colo, _best(p_held, kh))):
        q = float(p_end[j]) - t
        q = q if q > 0.0 else 0.0
        if q <= p_bound:
            pset_l.append(j)
            p_queue.append(q)
    # So are decode daemons above theirs: priced only when none within it can place.
    d_list = [i for i in sel_l if load[i] <= d_bound]
    # Tokens each candidate holds: from the few holders, not by asking every candidate.
    d_tok: dict[int, int] = {}
    p_tok: dict[int, int] = {}
    for url, blocks in hits.items():
        tokens = cached_tokens(prompt, blocks, px.block_size)
        if (i := d_of.get(url)) is not None:
            d_tok[i] = tokens
        if (j := p_of.get(url)) is not None:
            p_tok[j] = tokens
    tok = d_tok, p_tok
    found = (
        _priced(a, net, rtt, features, cfg, rng, limit, t, d_list, pset_l, p_queue, tok)
        if d_list
        else None
    )
    if found is None and len(d_list) < len(sel_l):
        found = _priced(a, net, rtt, features, cfg, rng, limit, t, sel_l, pset_l, p_queue,
                        tok, d_bound)  # fmt: skip
    return found or []


def _recent_of(a: LoadArrays, d_list: list[int], t: float) -> Callable[[int], float] | None:
    """Candidate k's recent placements by this router (rank's tie-break; asked for ties only)."""
    ledger = a.pending
    if ledger is None:
        return None
    return lambda k: ledger.recent(a.d[d_list[k]].url, t)


def _priced(
    a: LoadArrays, net: NetworkModel, rtt: ClientRtt, features: RequestFeatures,
    cfg: PlacementConfig, rng: random.Random, limit: int, t: float, d_list: list[int],
    pset_l: list[int], p_queue: list[float], tok: tuple[dict[int, int], dict[int, int]],
    d_bound: float | None = None,
) -> list[Placement] | None:  # fmt: skip
    """Decode rows ``d_list`` priced against prefill rows ``pset_l`` (within the bound, queues
    ``p_queue``); with ``d_bound``, rows above it are ranked only if none within can place.
    None: no row can place."""
    prompt = max(1, features.prompt_tokens)
    d_rows = a.row_arr[d_list].tolist()
    need = prompt + features.max_tokens
    net_l = [rtt(i) for i in d_list]
    admit_l = [0.0 if r[_FREE] >= need else r[_WAIT] for r in d_rows]
    d_tok, p_tok = tok  # prompt tokens cached, per decode and prefill row holding any
    d_cached = [d_tok.get(i, 0) for i in d_list]
    d_load = a.load[d_list].tolist()
    d_pop, p_pop, p_inv = a.d_pop_list, a.p_pop_list, a.p_inv_l
    # Per candidate, what price_pairs takes (prefix_pairs prices them). Comprehensions, not
    # one loop of appends: this runs for every decision with prefix hits.
    cands = Candidates(
        prompt, a.kv_bytes_per_token, a.chunk_tokens, cfg.work_weight,
        [n + ad + r[_PENALTY] for n, ad, r in zip(net_l, admit_l, d_rows)], d_cached,
        [r[_L_END] - t if r[_L_END] > t else 0.0 for r in d_rows],
        [r[_L_SPT] for r in d_rows],
        [prompt - c <= r[_L_MAX] for c, r in zip(d_cached, d_rows)],
        d_load, [True] * len(d_list) if d_bound is None else [x <= d_bound for x in d_load],
        [d_pop[i] for i in d_list], [p_tok.get(j, 0) for j in pset_l], p_queue,
        [p_inv[j] for j in pset_l], [True] * len(pset_l), [p_pop[j] for j in pset_l],
        a.geo.rtt, net.fixed_rtt_ms > 0, _recent_of(a, d_list, t),
    )  # fmt: skip
    chosen = choose(cands, net, cfg.near_tie_s, rng, limit)
    if not chosen:
        return None
    out = []
    for ch in chosen:
        d = a.d[d_list[ch.d]]
        prefill = a.p[pset_l[ch.prefill]] if ch.prefill >= 0 else None
        if prefill is not None and prefill.url == d.url:
            prefill = None  # a `both` daemon chosen as its own prefill peer is local prefill
        itl = d_rows[ch.d][_ITL]
        terms = {
            "net_s": net_l[ch.d], "admission_s": admit_l[ch.d], "prefill_queue_s": ch.queue_s,
            "prefill_compute_s": ch.compute_s, "kv_s": ch.kv_s, "itl_s": itl,
        }  # fmt: skip
        ttft = (
            terms["net_s"] + terms["admission_s"] + terms["prefill_queue_s"]
            + terms["prefill_compute_s"] + terms["kv_s"]
        )  # fmt: skip
        computed = ch.computed_tokens
        out.append(Placement(
            prefill, d, ttft, itl, itl <= cfg.itl_slo_s, terms,
            prefill_cached=prompt - computed, decode_cached=d_cached[ch.d],
            computed_tokens=computed,
        ))  # fmt: skip
    return out
