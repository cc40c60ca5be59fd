"""A request as the scheduler sees it: token ids, progress, blocks and lifecycle state."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

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
    arrival_time: float = field(default_factory=time.monotonic)
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    # Leading prompt tokens that came from the prefix cache at the last admission.
    num_cached_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    first_token_time: float | None = None

    def __post_init__(self) -> None:
        if self.num_prompt_tokens == 0:
            self.num_prompt_tokens = len(self.token_ids)

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

    def num_blocks_needed(self, num_tokens: int, block_size: int) -> int:
        return (num_tokens + block_size - 1) // block_size
