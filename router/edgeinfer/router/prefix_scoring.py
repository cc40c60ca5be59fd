"""What a cached prefix is worth to a placement, and the load guard that keeps it from a hot spot.

A prompt is a chain of blocks: a block's key stands for the whole prefix up to it, so a daemon
holding the first k keys of a prompt skips computing k blocks. For a (prefill P, decode D) pair:

    TTFT = RTT(client, D) + admission at D           as the prefix-blind selector
         + queue at P + compute of the suffix P lacks (its own hits are free)
         + KV transfer of the blocks D lacks           (what D holds need not move)

Local prefill (P = D) computes the suffix D lacks and moves nothing. The transfer uses the
network model's formulas (:meth:`NetworkModel.kv_exposed_s`: pages stream behind the compute,
the last chunk's cannot), between PoPs after their RTT, inside one PoP at the LAN's rate (the
prefix-blind selector prices that hop as free; with prompts of tens of thousands of tokens,
gigabytes of KV, it is not).

Candidates are ranked by that TTFT plus ``work_weight`` times the compute they add: under load
the requests queued behind a recomputed prefix wait for it too, so a choice that recomputes
what another daemon holds costs the fleet more than this request's TTFT shows.

Prefix hits pull every request sharing a prefix onto the daemons holding it: one system prompt
shared by all traffic would make one daemon the fleet's hot spot. The guard is bounded load
(consistent hashing with bounded loads, Mirrokni, Thorup and Zadimoghaddam, SODA 2018): a
daemon whose load is above ``1 + eps`` times the mean, this request included, is not a
candidate, so a hot prefix spills to the next daemons and they cache it too. Among the
candidates left, near-ties (within ``near_tie_s``) keep spreading load: the least loaded first
(:func:`rank`).

Pure numpy, no I/O: who holds which block (the index) is the caller's; :func:`leading_hits`
turns it into hits per daemon.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from edgeinfer.router.kv_pull import price_pull
from edgeinfer.router.network import FloatArray, NetworkModel

H = TypeVar("H", bound=Hashable)
BoolArray = npt.NDArray[np.bool_]


def leading_hits(keys: Sequence[int], holders: Mapping[int, Collection[H]]) -> dict[H, int]:
    """Per holder, how many of ``keys`` it holds from the first on (a gap ends the run: a block
    without its prefix cannot be used). Holders of none are absent. Costs the holders met, not
    the daemons there are."""
    hits: dict[H, int] = {}
    alive: set[H] | None = None
    for depth, key in enumerate(keys):
        have = holders.get(key, ())
        now = set(have) if alive is None else alive.intersection(have)
        if alive is not None:
            for h in alive.difference(now):
                hits[h] = depth
        alive = now
        if not alive:
            return hits
    for h in alive or ():
        hits[h] = len(keys)
    return hits


def cached_tokens(prompt_tokens: int, hit_blocks: int, block_size: int) -> int:
    """Prompt tokens a daemon holding ``hit_blocks`` leading blocks need not compute; the last
    token is always computed (its logits give the first output token), as in the engine."""
    return max(0, min(hit_blocks * block_size, prompt_tokens - 1))


def under_bound(load: FloatArray, added: float, eps: float) -> BoolArray:
    """The bounded-load guard: True where a daemon may take ``added`` more and stay within
    ``1 + eps`` times the mean load (this request included), with one request of slack: loads
    are small counts or seconds, and without it a daemon one request above a mean of two would
    lose every request its cache suits. Never all False (the least loaded is at most the mean)."""
    if not len(load):
        return np.zeros(0, dtype=bool)
    return np.asarray(load <= (1.0 + eps) * (float(load.sum()) + added) / len(load) + added)


@dataclasses.dataclass(frozen=True, slots=True)
class PairPrices:
    """Per decode daemon: the expected TTFT of its best prefill, and its terms."""

    ttft_s: FloatArray  # [D]; inf where no prefill is allowed
    score_s: FloatArray  # [D] what ranks them: TTFT + work_weight x the compute it adds
    prefill: npt.NDArray[np.intp]  # [D] index into the prefill daemons; -1: D prefills locally
    queue_s: FloatArray  # [D] the chosen prefill's queue
    compute_s: FloatArray  # [D] its compute of the uncached suffix
    kv_s: FloatArray  # [D] what the transfer adds (RTT included)
    computed_tokens: npt.NDArray[np.int64]  # [D] the suffix the chosen prefill computes


def price_pairs(
    net: NetworkModel,
    prompt: int,
    kv_bytes_per_token: int,
    chunk_tokens: int,
    d_base_s: FloatArray,
    d_cached: npt.NDArray[np.int64],
    local_queue_s: FloatArray,
    local_s_per_token: FloatArray,
    local_ok: BoolArray,
    p_cached: npt.NDArray[np.int64],
    p_queue_s: FloatArray,
    p_s_per_token: FloatArray,
    p_ok: BoolArray,
    rtt_s: FloatArray,
    work_weight: float = 0.0,
) -> PairPrices:
    """Every decode daemon [D] against local prefill and every allowed prefill daemon [P].

    ``d_base_s``: RTT(client, D) + admission (+ any SLO penalty); ``*_cached``: tokens each
    daemon need not compute (:func:`cached_tokens`); ``local_ok``: D may prefill itself (a
    ``both`` daemon, or a short uncached suffix); ``rtt_s`` [D, P]: 0 within a PoP.
    ``work_weight`` prices the compute a choice adds beyond this request's own wait: requests
    queued behind it wait for it too, so recomputing a prefix another daemon holds costs more
    than this request's TTFT shows."""
    local_tokens = prompt - d_cached
    local_compute = local_tokens * local_s_per_token
    local = np.where(local_ok, local_queue_s + local_compute, np.inf)
    local_score = local + work_weight * local_compute
    n_d, n_p = len(d_base_s), len(p_queue_s)
    if n_p:
        p_tokens = prompt - p_cached
        p_compute = p_tokens * p_s_per_token  # [P]
        moved = (prompt - d_cached).astype(np.float64)  # [D]: the blocks D lacks move
        far = rtt_s > 0  # [D, P]
        bytes_ = moved[:, None] * kv_bytes_per_token
        link = np.where(far, net.kv_link_s(bytes_), net.kv_link_s(bytes_, same_pop=True))
        kv = net.kv_exposed_s(link, p_compute[None, :], moved[:, None], chunk_tokens) + rtt_s
        total = np.where(p_ok[None, :], p_queue_s[None, :] + p_compute[None, :] + kv, np.inf)
        best = (total + work_weight * p_compute[None, :]).argmin(axis=1)
        rows = np.arange(n_d)
        remote = total[rows, best]
        remote_score = remote + work_weight * p_compute[best]
    else:
        best = np.zeros(n_d, dtype=np.intp)
        remote = remote_score = np.full(n_d, np.inf)
    use_local = local_score <= remote_score
    prefill = np.where(use_local, -1, best).astype(np.intp)
    if n_p:
        queue = np.where(use_local, local_queue_s, p_queue_s[best])
        compute = np.where(use_local, local_compute, p_compute[best])
        kv_s = np.where(use_local, 0.0, kv[rows, best])
        tokens = np.where(use_local, local_tokens, p_tokens[best])
    else:
        queue, compute, kv_s, tokens = local_queue_s, local_compute, np.zeros(n_d), local_tokens
    ttft = d_base_s + np.where(use_local, local, remote)
    score = d_base_s + np.where(use_local, local_score, remote_score)
    return PairPrices(ttft, score, prefill, queue, compute, kv_s, tokens.astype(np.int64))


def price_pairs_pulling(
    net: NetworkModel, prompt: int, kv_bytes_per_token: int, chunk_tokens: int,
    d_base_s: FloatArray, d_cached: npt.NDArray[np.int64], local_queue_s: FloatArray,
    local_s_per_token: FloatArray, local_ok: BoolArray, p_cached: npt.NDArray[np.int64],
    p_queue_s: FloatArray, p_s_per_token: FloatArray, p_ok: BoolArray, rtt_s: FloatArray,
    d_pop: npt.NDArray[np.intp] | npt.NDArray[np.int64], work_weight: float,
) -> PairPrices:  # fmt: skip
    """:func:`price_pairs` where a prefill daemon receives the blocks its decode daemon holds
    beyond its own hits when that is cheaper (:func:`~edgeinfer.router.kv_pull.price_pull`, the
    daemons' rule): for such a pair P computes only what neither holds, after the pull. What
    the router prices with (its compiled path, :func:`edgeinfer.router.prefix_pairs.search`,
    gives the same prices) and the simulator's prefix-aware policy too.

    ``price_pairs`` takes P's hits per prefill daemon, not per pair, so the decode daemons
    holding more than some prefill daemon are priced again in groups sharing their hits and PoP
    (``d_pop``; within one, the pull's price against each P is the same): P's hits raised by the
    pull, its queue by the pull's time (not by its work: the link is not the GPU). Decode
    daemons holding no more than every P keep the first pricing. A handful of groups per
    request: the holders."""
    prices = price_pairs(
        net, prompt, kv_bytes_per_token, chunk_tokens, d_base_s, d_cached, local_queue_s,
        local_s_per_token, local_ok, p_cached, p_queue_s, p_s_per_token, p_ok, rtt_s,
        work_weight,
    )  # fmt: skip
    if not len(p_cached):
        return prices
    groups: dict[tuple[int, int], list[int]] = {}
    for i in np.flatnonzero(d_cached > p_cached.min()).tolist():
        groups.setdefault((int(d_cached[i]), int(d_pop[i])), []).append(i)
    if not groups:
        return prices
    out = {f.name: np.array(getattr(prices, f.name)) for f in dataclasses.fields(PairPrices)}
    for (held, _), rows in groups.items():
        pull = price_pull(net, prompt, p_cached, held, p_s_per_token, kv_bytes_per_token,
                          rtt_s[rows[0]])  # fmt: skip
        sub = price_pairs(
            net, prompt, kv_bytes_per_token, chunk_tokens, d_base_s[rows], d_cached[rows],
            local_queue_s[rows], local_s_per_token[rows], local_ok[rows],
            p_cached + pull.pulled_tokens, p_queue_s + pull.pull_s, p_s_per_token, p_ok,
            rtt_s[rows], work_weight,
        )  # fmt: skip
        for name, column in out.items():
            column[rows] = getattr(sub, name)
    return PairPrices(**out)


def rank(
    ttft_s: FloatArray | Sequence[float], load: FloatArray | Sequence[float],
    allowed: BoolArray | Sequence[bool], near_tie_s: float, rng: random.Random, limit: int = 3,
    cached: npt.NDArray[np.int64] | Sequence[int] | None = None,
    recent: Callable[[int], float] | None = None,
) -> list[int]:  # fmt: skip
    """Decode daemons best first among ``allowed`` with a finite TTFT; of the near-ties of the
    best, the least loaded first. With ``cached`` (prompt tokens each would not compute) only
    the near-ties caching the most are considered: on a fast model a prefix's compute is within
    a near-tie, yet placing the request where its prefix lives keeps the conversation's next
    turn there too (the load guard, in ``allowed``, keeps that from a hot spot); equal hits
    still spread by load. Equal loads go to the daemon with the least ``recent(i)`` traffic
    (:meth:`~edgeinfer.router.inflight.PlacementLedger.recent`), then at random.

    The least loaded of all near-ties, not of two drawn at random as the prefix-blind selector
    does: a conversation stays where its first turn went, so a first turn given to the busier
    of two daemons by chance stays a hot spot for the conversation's life (with 12 conversations
    over 3 daemons, two random choices left one daemon 1.38x the mean). The loads include this
    router's own placements at once (the ledger), so it does not herd onto one daemon between
    heartbeats. Arrays (every daemon, the simulator) or lists. The router's prefix path runs
    this order compiled (:func:`edgeinfer.router.prefix_pairs.rank_found` and ``draw``), which
    ``tests/test_prefix_pairs.py`` holds to this function."""
    if isinstance(ttft_s, np.ndarray):
        idx = np.flatnonzero(np.asarray(allowed) & np.isfinite(ttft_s))
        if not len(idx):
            return []
        order = idx[np.argsort(ttft_s[idx], kind="stable")].tolist()
        # Python floats from here on: a handful of candidates, read one at a time.
        ttft_l = ttft_s.tolist()
    else:
        ttft_l = ttft_s if isinstance(ttft_s, list) else list(ttft_s)
        inf = math.inf
        # sorted() is stable, as the argsort above.
        order = sorted([i for i, x in enumerate(ttft_l) if allowed[i] and -inf < x < inf],
                       key=ttft_l.__getitem__)  # fmt: skip
        if not order:
            return []
    best = ttft_l[order[0]]
    ties = [i for i in order if ttft_l[i] <= best + near_tie_s]
    if cached is not None and ties:
        cached_l = cached.tolist() if isinstance(cached, np.ndarray) else cached
        most = max(cached_l[i] for i in ties)
        ties = [i for i in ties if cached_l[i] == most]
        if len(ties) == 1:
            order.remove(ties[0])
            order.insert(0, ties[0])
    if len(ties) >= 2:
        loads = [float(load[i]) for i in ties]
        least = min(loads)
        ties = [i for i, x in zip(ties, loads, strict=True) if x == least]
        if recent is not None and len(ties) >= 2:
            shares = [recent(i) for i in ties]
            least = min(shares)
            ties = [i for i, x in zip(ties, shares, strict=True) if x == least]
        first = ties[rng.randrange(len(ties))] if len(ties) >= 2 else ties[0]
        order.remove(first)
        order.insert(0, first)
    return order[:limit]
