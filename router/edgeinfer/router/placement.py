"""What the selector takes (a request's features, its settings) and gives (placements), shared by
its paths."""

from __future__ import annotations

import dataclasses
import functools
import statistics
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import NamedTuple

from edgeinfer.router.pop_registry import DaemonView


@dataclasses.dataclass(frozen=True, slots=True)
class PrefixHits:
    """A request's prefix knowledge (:mod:`edgeinfer.router.prefix_lookup`): the prompt's exact
    length, its full blocks, and per daemon URL the leading blocks held (none: absent).

    With ``lookup`` the hits are not known yet: the selector asks it for the daemons it may
    place on (its candidates), as asking the index for every daemon of a fleet costs ~2 ms."""

    prompt_tokens: int
    blocks: int
    block_size: int
    hits: dict[str, int]
    lookup: Callable[[Collection[str]], dict[str, int]] | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class RequestFeatures:
    prompt_tokens: int
    max_tokens: int
    model: str | None  # None: the most widely served model
    # Which daemons hold the prompt's leading blocks (None: unknown, e.g. no tokenizer yet).
    prefix: PrefixHits | None = None
    # x-session-affinity, hashed with the tenant (session_affinity.affinity_key); 0: none.
    affinity: int = 0


class Placement(NamedTuple):
    """One (prefill, decode) choice and its expected latencies. A named tuple: a decision
    builds three, and a frozen dataclass's field-by-field ``__init__`` costs microseconds."""

    prefill: DaemonView | None  # None: the decode daemon prefills locally
    decode: DaemonView
    ttft_s: float
    itl_s: float
    meets_slo: bool
    breakdown: dict[str, float]  # the TTFT terms (they sum to ttft_s) and itl_s
    # Prompt tokens the prefilling daemon holds cached, those D holds (what need not move), and
    # the suffix that is computed; without prefix knowledge 0, 0 and the whole prompt.
    prefill_cached: int = 0
    decode_cached: int = 0
    computed_tokens: int | None = None

    def describe(self) -> str:
        b = {k: round(v * 1000, 1) for k, v in self.breakdown.items()}
        where = "local" if self.prefill is None else f"{self.prefill.url} ({self.prefill.pop})"
        slo = "" if self.meets_slo else " OVER SLO"
        return (
            f"decode {self.decode.url} ({self.decode.pop}) prefill {where}: ttft "
            f"{self.ttft_s * 1000:.1f}ms = net {b['net_s']} + admit {b['admission_s']} + queue "
            f"{b['prefill_queue_s']} + compute {b['prefill_compute_s']} + kv {b['kv_s']}; "
            f"itl {b['itl_s']}ms; cached tokens prefill {self.prefill_cached} decode "
            f"{self.decode_cached}{slo}"
        )


@dataclasses.dataclass(frozen=True)
class PlacementConfig:
    itl_slo_s: float = 0.1
    near_tie_s: float = 0.02
    # The prompt size a "short" pruning key and the prefill pool are judged on (which daemons
    # may prefill locally is their own local_prefill_threshold, from their heartbeats).
    short_prompt_tokens: int = 512
    prefill_chunk_tokens: int = 2048  # the last chunk's pages cannot hide behind compute
    # Assumed of a daemon that has not measured itself (rates are 0 in its first heartbeats)
    # while no daemon of its model has either (see Assumed).
    default_prefill_tokens_per_s: float = 5000.0
    default_decode_tokens_per_s: float = 1000.0
    default_itl_s: float = 0.03
    mean_output_tokens: int = 256  # how long a running request holds its slot, on average
    decode_candidates: int = 8  # D kept after the lower-bound pass
    prefill_pool: int = 8  # cheapest prefill daemons priced for every kept D (per prompt size)
    # Bounded load: no daemon above 1 + eps times the mean takes a request for its cache (or a
    # session's affinity): a hot prefix spills over (prefix_scoring.under_bound).
    load_eps: float = 0.25
    affinity_slack_s: float = 0.05  # a session's daemon is kept while within this of the best
    prefix_candidates: int = 4  # holders of a prompt's prefix priced beside the pruned ones
    # Decode daemons (the best by network and static cost) whose caches the index is asked
    # about per request, with the prefill daemons that may serve them: not the whole fleet.
    prefix_lookup_candidates: int = 16
    work_weight: float = 1.0  # prefix placements: the compute a choice adds (price_pairs)


class Assumed:
    """What the selector assumes of a daemon that has not measured itself yet (a fresh start:
    its rates are 0 and its ITL unknown until it has served, and an idle daemon's ITL ages
    out): the median of the daemons of its model that have, and ``PlacementConfig``'s defaults
    only while none has.

    A default above what the fleet measures makes every fresh daemon look the fastest: beside
    two daemons measuring ~700 prefill tokens/s, a third that had not reported a rate yet was
    priced at the default 5,000 and took all three long prompts of a burst (a cold daemon
    flooded after a restart or a scale-out). Each median is taken when first asked for, so a
    fleet whose daemons have all measured themselves pays nothing (0.16 ms at 700 daemons)."""

    def __init__(self, views: Sequence[DaemonView], cfg: PlacementConfig) -> None:
        """``views``: one model's daemons (those that have measured themselves count)."""
        self._views, self._cfg = views, cfg

    @functools.cached_property
    def prefill_tokens_per_s(self) -> float:
        rates = (v.prefill_tokens_per_s for v in self._views)
        return _median(rates, self._cfg.default_prefill_tokens_per_s)

    @functools.cached_property
    def decode_tokens_per_s(self) -> float:
        rates = (v.decode_tokens_per_s for v in self._views)
        return _median(rates, self._cfg.default_decode_tokens_per_s)

    @functools.cached_property
    def itl_s(self) -> float:
        return _median((v.itl_p50_s or 0.0 for v in self._views), self._cfg.default_itl_s)


def _median(values: Iterable[float], default: float) -> float:
    measured = [x for x in values if x > 0]
    return statistics.median(measured) if measured else default
