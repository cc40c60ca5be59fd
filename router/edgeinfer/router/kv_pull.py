"""Pull or recompute: whether a prefill daemon receives the prefix pages its decode daemon holds.

A P/D pair for one prompt: P holds its first ``p_cached`` tokens, D its first ``d_cached`` (both
as :func:`edgeinfer.router.prefix_scoring.cached_tokens` counts them). Where D holds more, P can
receive tokens ``p_cached..d_cached`` from D over the KV plane instead of computing them. The
rule, the same in the daemon's KV plane (which may not import router code, so it restates it):

    pull  iff  RTT(P, D) + pulled tokens x KV bytes per token / link rate
               <  pulled tokens x P's prefill seconds per token

The pull is one round trip (P asks for the pages, D sends them; 0 inside a PoP, as everywhere in
:class:`~edgeinfer.router.network.NetworkModel`) plus the bytes at the link's rate between PoPs
or inside one. None of it hides behind compute: the suffix P computes attends to the pulled
pages, so they must be there first. The link's time is not the fleet's GPU time, so a caller
weighing the compute a choice adds (``prefix_scoring.price_pairs``' ``work_weight``) weighs
``compute_s`` only.

With Llama-3-8B's 128 KiB of KV per token and a GPU prefilling ~25k tokens/s, a pull inside a
PoP (100 Gb/s) costs about a quarter of the recompute; between PoPs (10 Gb/s) over twice it, so
pulls are, in practice, a PoP's affair: a prefill daemon beside the decode daemon that holds the
conversation is as good as one holding it itself.

Pure numpy over scalars or arrays that broadcast (the selector's [D, P] pairs, the simulator's
one pair), like the network formulas it uses.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from edgeinfer.router.network import NetworkModel


@dataclasses.dataclass(frozen=True, slots=True)
class PullPrice:
    """The prefill side of a pair, each field shaped as the inputs broadcast."""

    pull: Any  # bool: P receives D's extra pages
    pulled_tokens: Any  # tokens received from D (0 where not pulled)
    pull_s: Any  # what the pull adds before P computes (0 where not pulled)
    computed_tokens: Any  # the tokens P computes
    compute_s: Any  # their compute
    cost_s: Any  # pull_s + compute_s: the prefill side's expected time, its queue aside


def price_pull(
    net: NetworkModel,
    prompt_tokens: Any,
    p_cached: Any,
    d_cached: Any,
    p_s_per_token: Any,
    kv_bytes_per_token: int,
    rtt_s: Any,
) -> PullPrice:
    """Pull or recompute the tokens D holds beyond P's hits, and what P's side then costs.

    ``p_cached``/``d_cached``: prompt tokens P and D need not compute; ``p_s_per_token``: P's
    prefill seconds per token over the tokens in question; ``rtt_s``: RTT between P's and D's
    PoPs, 0 inside one (the link is then the PoP's LAN). Python scalars in, Python scalars out
    (the same expressions without numpy's cost per call: a router pricing a few pairs)."""
    if all(isinstance(x, int | float) for x in (p_cached, d_cached, p_s_per_token, rtt_s)):
        extra_n = max(d_cached - p_cached, 0)
        link_s = net.kv_link_s(extra_n * kv_bytes_per_token, same_pop=not rtt_s > 0)
        take = extra_n > 0 and rtt_s + link_s < extra_n * p_s_per_token
        pulled_n = extra_n if take else 0
        computed_n = prompt_tokens - p_cached - pulled_n
        pull_n_s = rtt_s + link_s if take else 0.0
        compute_n_s = computed_n * p_s_per_token
        return PullPrice(take, pulled_n, pull_n_s, computed_n, compute_n_s, pull_n_s + compute_n_s)
    extra = np.maximum(np.subtract(d_cached, p_cached), 0)
    bytes_ = extra * kv_bytes_per_token
    far = np.greater(rtt_s, 0)
    link = np.where(far, net.kv_link_s(bytes_), net.kv_link_s(bytes_, same_pop=True))
    pull_s = np.add(rtt_s, link)
    pull = (extra > 0) & (pull_s < extra * np.asarray(p_s_per_token))
    pulled = np.where(pull, extra, 0)
    computed = np.subtract(prompt_tokens, p_cached) - pulled
    compute_s = computed * np.asarray(p_s_per_token)
    pull_s = np.where(pull, pull_s, 0.0)
    return PullPrice(pull, pulled, pull_s, computed, compute_s, pull_s + compute_s)
