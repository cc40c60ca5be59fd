"""Log-probs in the API's shapes: OpenAI's legacy completion lists, chat's ``content`` entries,
and vLLM's ``prompt_logprobs`` (one ``{token id: {logprob, rank, decoded_token}}`` per token).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from edgeinfer.daemon.engine.outputs import TokenLogprob
from edgeinfer.daemon.engine.tokenizer import Tokenizer


class LogprobFormat:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer

    def token(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def completion(
        self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob | None], offset: int, k: int
    ) -> dict[str, Any]:
        """The legacy shape: parallel lists, offsets into the choice's text, ``k``
        alternatives at most per token. A None log-prob is an echoed first prompt token, which
        has no context to be scored in (null, as in OpenAI's and vLLM's answers)."""
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for token_id, lp in zip(token_ids, logprobs, strict=True):
            token = self.token(token_id)
            tokens.append(token)
            offsets.append(offset)
            offset += len(token)
            if lp is None:
                token_logprobs.append(None)
                top.append(None)
                continue
            token_logprobs.append(lp.logprob)
            # vLLM's convention: the chosen token is always among the alternatives.
            top.append({self.token(t): p for t, p in lp.top[:k]} | {token: lp.logprob})
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def chat(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        content = []
        for lp in logprobs:
            entry = self._chat_entry(lp.token_id, lp.logprob)
            entry["top_logprobs"] = [self._chat_entry(t, p) for t, p in lp.top]
            content.append(entry)
        return {"content": content, "refusal": None}

    def _chat_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self.token(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    def prompt(
        self, scores: Sequence[TokenLogprob | None], k: int
    ) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's ``prompt_logprobs``: per prompt token the token itself and the ``k`` most
        likely ones, keyed by token id; the first token is None."""
        out: list[dict[str, dict[str, Any]] | None] = []
        for lp in scores:
            if lp is None:
                out.append(None)
                continue
            entry = {
                str(t): self._vllm_entry(t, p, rank) for rank, (t, p) in enumerate(lp.top[:k], 1)
            }
            entry[str(lp.token_id)] = self._vllm_entry(lp.token_id, lp.logprob, lp.rank)
            out.append(entry)
        return out

    def _vllm_entry(self, token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": self.token(token_id)}
