"""Per-request text state: incremental detokenization and stop conditions."""

from __future__ import annotations

from edgeinfer.daemon.engine.outputs import TokenLogprob
from edgeinfer.daemon.engine.sequence import FinishReason, Sequence
from edgeinfer.daemon.engine.stop_checker import StopChecker
from edgeinfer.daemon.engine.tokenizer import IncrementalDetokenizer, Tokenizer


class RequestState:
    """A sequence plus what turns its tokens into text and decides when it ends."""

    def __init__(self, seq: Sequence, tokenizer: Tokenizer) -> None:
        self.seq = seq
        p = seq.params
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, seq.prompt_token_ids, skip_special_tokens=p.skip_special_tokens
        )
        self.stop_checker = StopChecker(p.stop, p.include_stop_str_in_output) if p.stop else None
        self._pending_text = ""
        # Entry i scores prompt token i (the first has no context: None); handed out once.
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            None if p.prompt_logprobs is None else [None]
        )

    def record_prompt_logprob(self, index: int, logprob: TokenLogprob) -> None:
        """Keep the score of prompt token ``index``; a recomputation after a preemption
        scores tokens again, and the first score is kept."""
        if self.prompt_logprobs is not None and index == len(self.prompt_logprobs):
            self.prompt_logprobs.append(logprob)

    def take_prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """The prompt's scores, once (with the first output); None afterwards."""
        scores, self.prompt_logprobs = self.prompt_logprobs, None
        return scores

    def append_token(
        self, token: int, max_model_len: int
    ) -> tuple[FinishReason | None, str | int | None]:
        """Add a sampled token; returns why the request ends now, if it does."""
        seq, p = self.seq, self.seq.params
        seq.token_ids.append(token)
        seq.sampling.append(token)
        delta = self.detokenizer.push(token)
        if self.stop_checker is not None:
            delta, hit = self.stop_checker.feed(delta)
            self._pending_text += delta
            if hit:
                return FinishReason.STOP, self.stop_checker.stop_str
        else:
            self._pending_text += delta
        n_out = seq.num_output_tokens
        if n_out >= p.min_tokens:
            if token in p.stop_token_ids:
                return FinishReason.STOP, token
            if not p.ignore_eos and token in seq.sampling.eos_token_ids:
                return FinishReason.STOP, None
        if n_out >= p.max_tokens or seq.num_tokens >= max_model_len:
            return FinishReason.LENGTH, None
        return None, None

    def take_text(self, final: bool) -> str:
        """Text safe to emit now; at the end, also what the stop checker held back."""
        if final and self.stop_checker is not None and not self.stop_checker.stopped:
            self._pending_text += self.stop_checker.flush()
        text, self._pending_text = self._pending_text, ""
        return text
