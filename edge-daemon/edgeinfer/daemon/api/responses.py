"""OpenAI response objects and SSE chunks, for ``text_completion`` and ``chat.completion``.

Field names follow the OpenAI API plus vLLM's extensions (``stop_reason``; with
``return_token_ids``: ``prompt_token_ids`` and ``token_ids``), so clients written for either
work unchanged.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson

from edgeinfer.daemon.api.protocol import GenerateRequest
from edgeinfer.daemon.engine.outputs import RequestOutput, TokenLogprob
from edgeinfer.daemon.engine.tokenizer import Tokenizer

SSE_DONE = b"data: [DONE]\n\n"


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


@dataclass
class Choice:
    """Everything one choice (one prompt) produced so far."""

    index: int
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0

    def add(self, out: RequestOutput) -> None:
        self.text += out.new_text
        self.token_ids.extend(out.new_token_ids)
        self.logprobs.extend(out.new_logprobs or ())
        self.num_cached_tokens = out.num_cached_tokens
        if out.finished:
            self.finish_reason = out.finish_reason
            self.stop_reason = out.stop_reason


class ResponseBuilder:
    """Builds the response or the chunks of one request, in its API's shape."""

    def __init__(self, req: GenerateRequest, model: str, tokenizer: Tokenizer) -> None:
        self.req = req
        self.chat = req.kind == "chat"
        prefix = "chatcmpl" if self.chat else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self._tokenizer = tokenizer
        self.choices = [Choice(i, ids) for i, ids in enumerate(req.prompts)]
        self._started: set[int] = set()  # choices whose first chunk went out

    def _head(self, streaming: bool) -> dict[str, Any]:
        if self.chat:
            obj = "chat.completion.chunk" if streaming else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # ---- streaming ---------------------------------------------------------------------
    def chunks(self, index: int, out: RequestOutput) -> list[dict[str, Any]]:
        """Record ``out`` for choice ``index`` and return the chunks to send for it."""
        choice = self.choices[index]
        offset = len(choice.text)
        choice.add(out)
        first = index not in self._started
        self._started.add(index)
        chunks: list[dict[str, Any]] = []
        item: dict[str, Any] = {"index": index}
        if self.chat:
            if first:
                # OpenAI opens every chat choice with the role before any content.
                opening = {**self._head(True), "choices": [{**item, "delta": _role_delta()}]}
                if self.req.return_token_ids:
                    opening["prompt_token_ids"] = choice.prompt_token_ids
                chunks.append(opening)
            item["delta"] = {"content": out.new_text}
            item["logprobs"] = self._chat_logprobs(out.new_logprobs)
        else:
            item["text"] = out.new_text
            item["logprobs"] = self._completion_logprobs(out.new_logprobs, offset)
            if first and self.req.return_token_ids:
                item["prompt_token_ids"] = choice.prompt_token_ids
        item["finish_reason"] = out.finish_reason if out.finished else None
        item["stop_reason"] = out.stop_reason if out.finished else None
        if self.req.return_token_ids:
            item["token_ids"] = out.new_token_ids
        chunks.append({**self._head(True), "choices": [item]})
        return chunks

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._head(True), "choices": [], "usage": self.usage()}

    # ---- whole response ----------------------------------------------------------------
    def response(self) -> dict[str, Any]:
        items = []
        for c in self.choices:
            item: dict[str, Any] = {"index": c.index}
            if self.chat:
                item["message"] = {"role": "assistant", "content": c.text}
                item["logprobs"] = self._chat_logprobs(c.logprobs or None)
            else:
                item["text"] = c.text
                item["logprobs"] = self._completion_logprobs(c.logprobs or None, 0)
                if self.req.return_token_ids:
                    item["prompt_token_ids"] = c.prompt_token_ids
            item["finish_reason"] = c.finish_reason
            item["stop_reason"] = c.stop_reason
            if self.req.return_token_ids:
                item["token_ids"] = c.token_ids
            items.append(item)
        body = {**self._head(False), "choices": items, "usage": self.usage()}
        if self.chat and self.req.return_token_ids:
            body["prompt_token_ids"] = self.choices[0].prompt_token_ids
        return body

    def usage(self) -> dict[str, Any]:
        prompt = sum(len(c.prompt_token_ids) for c in self.choices)
        completion = sum(len(c.token_ids) for c in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {
                "cached_tokens": sum(c.num_cached_tokens for c in self.choices)
            },
        }

    # ---- logprobs ----------------------------------------------------------------------
    def _token(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def _completion_logprobs(
        self, logprobs: list[TokenLogprob] | None, offset: int
    ) -> dict[str, Any] | None:
        """The legacy shape: parallel lists, offsets into the choice's text."""
        if self.req.params.logprobs is None or logprobs is None:
            return None
        tokens = [self._token(lp.token_id) for lp in logprobs]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        top = [
            # vLLM's convention: the sampled token is always among the alternatives.
            {self._token(t): p for t, p in lp.top} | {tokens[i]: lp.logprob}
            for i, lp in enumerate(logprobs)
        ]
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def _chat_logprobs(self, logprobs: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if self.req.params.logprobs is None or logprobs is None:
            return None
        content = []
        for lp in logprobs:
            entry = self._chat_entry(lp.token_id, lp.logprob)
            entry["top_logprobs"] = [self._chat_entry(t, p) for t, p in lp.top]
            content.append(entry)
        return {"content": content, "refusal": None}

    def _chat_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self._token(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def _role_delta() -> dict[str, Any]:
    return {"role": "assistant", "content": ""}
