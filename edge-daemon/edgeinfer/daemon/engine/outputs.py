"""What the engine hands back each step: per-request deltas, plus engine-wide stats."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the most likely alternatives, best first
    rank: int | None = None  # 1 = the most likely token; set for prompt logprobs


@dataclass(slots=True)
class RequestOutput:
    """New tokens and text of one request since its previous output.

    ``kv_blocks_ready`` (prefill-only requests) counts the leading logical KV blocks whose
    every token is computed, so a transfer can ship them while later chunks still run.
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    kv_blocks_ready: int = 0
    # With ``prompt_logprobs``, on the first output: one entry per prompt token, the first None.
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_remote_pending: int
    num_prefilled_held: int
    kv_blocks_total: int
    kv_blocks_used: int
    prefix_cache_queries: int  # blocks looked up
    prefix_cache_hits: int  # blocks found
    num_preemptions: int
    prompt_tokens_computed: int
    generation_tokens: int
    queued_prompt_tokens: int = 0  # prompt tokens admitted but not computed yet

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0
