"""A request as the scheduler sees it: token ids, progress, blocks and lifecycle state."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from edgeinfer.daemon.engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from edgeinfer.daemon.engine.sampler import SamplingState
    from edgeinfer.daemon.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    # Decode side of a disaggregated request: blocks reserved, KV pages arriving.
    REMOTE_PENDING = "remote_pending"
    # Prefill-only request whose KV blocks are held until the transfer is released.
    PREFILLED = "prefilled"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, stop token id or stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"
    PREFILLED = "prefilled"  # prefill-only request done; KV ready to export


@dataclass(eq=False)
class Sequence:
    """One request. ``token_ids`` holds the prompt followed by the generated tokens.

    ``num_computed_tokens`` counts tokens whose K/V sit in the cache; the scheduler feeds
    the model ``token_ids[num_computed_tokens:]`` (in chunks under the step budget).
    """

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    sampling: SamplingState
    prefill_only: bool = False
    # Seeds the prefix-cache key chain: only sequences with equal salts share blocks.
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    # Leading prompt tokens whose KV was not computed for this request: the prefix-cache hit
    # of its first admission (a readmission after preemption finds blocks it computed itself),
    # or, prefilled remotely, what the prefill side's cache held.
    num_cached_tokens: int = 0
    # Decode side of a remote prefill: leading tokens whose blocks this engine's prefix cache
    # held at the reservation; shared blocks, never written by an import.
    num_held_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    first_token_time: float | None = None

    def __post_init__(self) -> None:
        if self.num_prompt_tokens == 0:
            self.num_prompt_tokens = len(self.token_ids)
        salt = self.cache_salt
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise InvalidRequestError("cache_salt must be a non-empty string", param="cache_salt")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def max_prefix_hit_tokens(self) -> int:
        """Leading tokens a prefix-cache hit may cover at admission. One token stays
        uncomputed so the model runs and yields the next token's logits; a request asking for
        prompt logprobs takes no hit (cached blocks hold K/V, not the logits it needs)."""
        return 0 if self.params.prompt_logprobs is not None else self.num_tokens - 1

    def prompt_logprob_positions(self, num_new_tokens: int) -> range:
        """Positions among the next ``num_new_tokens`` whose logits score the prompt token that
        follows them (empty unless prompt logprobs were asked for)."""
        if self.params.prompt_logprobs is None:
            return range(0)
        start = self.num_computed_tokens
        return range(start, min(start + num_new_tokens, self.num_prompt_tokens - 1))

    def num_blocks_needed(self, num_tokens: int, block_size: int) -> int:
        return (num_tokens + block_size - 1) // block_size
