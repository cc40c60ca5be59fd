"""Pull or recompute: whether a prefill daemon receives pages its decode daemon holds.

When the decode daemon offers leading blocks beyond the prefill daemon's own prefix-cache hits
(a multi-turn chat: it holds the previous turn's prompt *and* answer), the prefill daemon may
receive them over the KV plane instead of computing them. The rule is the router's
(:mod:`edgeinfer.router.kv_pull`, which the daemon may not import, so it is restated here)::

    pull  iff  RTT + pulled tokens x KV bytes per token / link rate
               <  pulled tokens / prefill tokens per second

Nothing of the pull hides behind compute: the suffix attends to the pulled pages, so they must
be there first. The prefill daemon uses its own measurements: its prefill rate over recent
engine steps (the heartbeat's ``prefill_tokens_per_s``) and, from its earlier pulls, the round
trip (the first page's latency) and the link's rate (bytes over the pull's whole time, so a
conservative figure). Until it has measured them it assumes :data:`DEFAULT_PRICES`: a fast
prefill and a slow link with a cross-PoP round trip, so an unmeasured daemon pulls only where
recomputing would clearly cost more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PullPrices:
    """What one decision weighs; rates > 0, times >= 0."""

    prefill_tokens_per_s: float
    link_bytes_per_s: float
    rtt_s: float


# Conservative stand-ins for what is not measured yet (each taken alone, not as a set): a
# prefill as fast as a large GPU's on a small model, a 1 Gb/s link, a 50 ms round trip.
DEFAULT_PRICES = PullPrices(prefill_tokens_per_s=50_000.0, link_bytes_per_s=125e6, rtt_s=0.05)


def pull_saves_time(pull_tokens: int, kv_bytes_per_token: int, prices: PullPrices) -> bool:
    """True when receiving ``pull_tokens`` tokens' pages is faster than computing them."""
    if pull_tokens <= 0:
        return False
    transfer_s = prices.rtt_s + pull_tokens * kv_bytes_per_token / prices.link_bytes_per_s
    return transfer_s < pull_tokens / prices.prefill_tokens_per_s


def measured_prices(
    prefill_tokens_per_s: float | None,
    link_bytes_per_s: float | None,
    rtt_s: float | None,
    defaults: PullPrices = DEFAULT_PRICES,
) -> PullPrices:
    """The prices to decide with: each measurement where there is one, else its default
    (a rate of 0 is what an unmeasured meter reads)."""
    return PullPrices(
        _or(prefill_tokens_per_s, defaults.prefill_tokens_per_s),
        _or(link_bytes_per_s, defaults.link_bytes_per_s),
        rtt_s if rtt_s is not None and math.isfinite(rtt_s) and rtt_s >= 0 else defaults.rtt_s,
    )


def _or(rate: float | None, default: float) -> float:
    return rate if rate is not None and math.isfinite(rate) and rate > 0 else default
