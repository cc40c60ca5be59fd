"""OpenAI response objects and SSE chunks, for ``text_completion`` and ``chat.completion``.

Field names follow the OpenAI API plus vLLM's extensions (``stop_reason``; with
``return_token_ids``: ``prompt_token_ids`` and ``token_ids``; ``prompt_logprobs``), so clients
written for either work unchanged.

A request has ``n`` choices per prompt (choice ``prompt index * n + i``); only the first choice
of each prompt scores the prompt (the engine hands the scores out with its first output) and
the others show the same scores. ``echo`` puts the prompt in front of each choice's text (and
its tokens in front of the logprobs); ``prompt_only`` (``max_tokens: 0``) leaves out the one
token the engine sampled, so the answer holds the prompt alone.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson

from edgeinfer.daemon.api.logprob_format import LogprobFormat
from edgeinfer.daemon.api.protocol import GenerateRequest
from edgeinfer.daemon.api.tool_parsers import ToolCall, ToolCallStream
from edgeinfer.daemon.engine.outputs import RequestOutput, TokenLogprob
from edgeinfer.daemon.engine.tokenizer import Tokenizer

SSE_DONE = b"data: [DONE]\n\n"

PromptScores = list[TokenLogprob | None]


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


@dataclass
class Choice:
    """Everything one choice produced so far."""

    index: int
    prompt_index: int
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0

    def add(self, out: RequestOutput, keep_tokens: bool) -> None:
        if keep_tokens:
            self.text += out.new_text
            self.token_ids.extend(out.new_token_ids)
            self.logprobs.extend(out.new_logprobs or ())
        self.num_cached_tokens = out.num_cached_tokens
        if out.finished:
            self.finish_reason = out.finish_reason
            self.stop_reason = out.stop_reason
            if not keep_tokens and out.finish_reason == "stop":
                # The token that stopped it is not part of the answer: max_tokens 0 was reached.
                self.finish_reason, self.stop_reason = "length", None


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
        self._format = LogprobFormat(tokenizer)
        self.choices = [
            Choice(p * req.n + i, p, ids) for p, ids in enumerate(req.prompts) for i in range(req.n)
        ]
        self._scores: dict[int, PromptScores] = {}  # prompt index -> its prompt's scores
        self._started: set[int] = set()  # choices whose first chunk went out
        self._tool_streams: dict[int, ToolCallStream] = {}  # choice -> its calls so far

    def _head(self, streaming: bool) -> dict[str, Any]:
        if self.chat:
            obj = "chat.completion.chunk" if streaming else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def add(self, index: int, out: RequestOutput) -> None:
        """Record ``out`` for choice ``index``."""
        choice = self.choices[index]
        if out.prompt_logprobs is not None:
            self._scores[choice.prompt_index] = out.prompt_logprobs
        choice.add(out, keep_tokens=not self.req.prompt_only)

    # ---- streaming ---------------------------------------------------------------------
    def chunks(self, index: int, out: RequestOutput) -> list[dict[str, Any]]:
        """Record ``out`` for choice ``index`` and return the chunks to send for it."""
        choice = self.choices[index]
        offset = len(choice.text)
        self.add(index, out)
        first = index not in self._started
        self._started.add(index)
        keep = not self.req.prompt_only
        new_ids = out.new_token_ids if keep else []
        new_text = out.new_text if keep else ""
        new_logprobs = (out.new_logprobs or []) if keep else []
        chunks: list[dict[str, Any]] = []
        item: dict[str, Any] = {"index": index}
        if self.chat:
            if first:
                # OpenAI opens every chat choice with the role before any content.
                opening = {**self._head(True), "choices": [{**item, "delta": _role_delta()}]}
                if self.req.return_token_ids:
                    opening["prompt_token_ids"] = choice.prompt_token_ids
                if self.req.prompt_logprobs is not None:
                    opening["prompt_logprobs"] = self._prompt_logprobs(choice)
                chunks.append(opening)
            deltas = self._chat_deltas(index, new_text, out.finished)
            for delta in deltas[:-1]:
                # Each tool-call delta in its own chunk, as OpenAI streams them.
                part = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
                chunks.append({**self._head(True), "choices": [part]})
            item["delta"] = deltas[-1]
            item["logprobs"] = self._chat_logprobs(new_logprobs)
        else:
            ids, text = new_ids, new_text
            lps: list[TokenLogprob | None] = list(new_logprobs)
            if first and self.req.echo:
                ids = choice.prompt_token_ids + ids
                lps = self._echo_scores(choice) + lps
                text = self._prompt_text(choice) + text
            elif self.req.echo:
                offset += len(self._prompt_text(choice))
            item["text"] = text
            item["logprobs"] = self._completion_logprobs(ids, lps, 0 if first else offset)
            if first and self.req.return_token_ids:
                item["prompt_token_ids"] = choice.prompt_token_ids
            if first and self.req.prompt_logprobs is not None:
                item["prompt_logprobs"] = self._prompt_logprobs(choice)
        item["finish_reason"] = self._finish_reason(choice) if out.finished else None
        item["stop_reason"] = choice.stop_reason if out.finished else None
        if self.req.return_token_ids:
            item["token_ids"] = new_ids
        chunk = {**self._head(True), "choices": [item]}
        if self.req.continuous_usage:
            chunk["usage"] = self.usage()
        chunks.append(chunk)
        return chunks

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._head(True), "choices": [], "usage": self.usage()}

    # ---- whole response ----------------------------------------------------------------
    def response(self) -> dict[str, Any]:
        items = []
        for c in self.choices:
            item: dict[str, Any] = {"index": c.index}
            if self.chat:
                item["message"] = self._message(c)
                item["logprobs"] = self._chat_logprobs(c.logprobs)
            else:
                ids, text = c.token_ids, c.text
                lps: list[TokenLogprob | None] = list(c.logprobs)
                if self.req.echo:
                    ids = c.prompt_token_ids + ids
                    lps = self._echo_scores(c) + lps
                    text = self._prompt_text(c) + text
                item["text"] = text
                item["logprobs"] = self._completion_logprobs(ids, lps, 0)
                if self.req.return_token_ids:
                    item["prompt_token_ids"] = c.prompt_token_ids
                if self.req.prompt_logprobs is not None:
                    item["prompt_logprobs"] = self._prompt_logprobs(c)
            item["finish_reason"] = self._finish_reason(c)
            item["stop_reason"] = c.stop_reason
            if self.req.return_token_ids:
                item["token_ids"] = c.token_ids
            items.append(item)
        body = {**self._head(False), "choices": items, "usage": self.usage()}
        if self.chat and self.req.return_token_ids:
            body["prompt_token_ids"] = self.choices[0].prompt_token_ids
        if self.chat and self.req.prompt_logprobs is not None:
            # vLLM's chat answer carries them once, beside the choices.
            body["prompt_logprobs"] = self._prompt_logprobs(self.choices[0])
        return body

    def usage(self) -> dict[str, Any]:
        """The prompt counted once however many choices share it (it is prefilled once)."""
        firsts = [c for c in self.choices if c.index % self.req.n == 0]
        prompt = sum(len(c.prompt_token_ids) for c in firsts)
        completion = sum(len(c.token_ids) for c in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(c.num_cached_tokens for c in firsts)},
        }

    # ---- tool calls ---------------------------------------------------------------------
    def _message(self, choice: Choice) -> dict[str, Any]:
        tools = self.req.tools
        if tools is None or not tools.parses:
            return {"role": "assistant", "content": choice.text}
        content, calls = tools.parser.extract(choice.text)
        self._tool_streams[choice.index] = stream = ToolCallStream(tools.parser)
        stream.calls.extend(calls)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [c.as_openai() for c in calls]
        return message

    def _chat_deltas(self, index: int, text: str, finished: bool) -> list[dict[str, Any]]:
        """A chat choice's next deltas: its content, then each finished call (a delta naming
        it with empty arguments, then one with the arguments)."""
        tools = self.req.tools
        if tools is None or not tools.parses:
            return [{"content": text}]
        stream = self._tool_streams.setdefault(index, ToolCallStream(tools.parser))
        content, calls = stream.feed(text)
        if finished:
            rest, more = stream.finish()
            content, calls = content + rest, calls + more
        deltas: list[dict[str, Any]] = [{"content": content}] if content or not calls else []
        first = len(stream.calls) - len(calls)
        for i, call in enumerate(calls, first):
            deltas.extend(_call_deltas(i, call))
        return deltas

    def _finish_reason(self, choice: Choice) -> str | None:
        stream = self._tool_streams.get(choice.index)
        if choice.finish_reason == "stop" and stream is not None and stream.calls:
            return "tool_calls"
        return choice.finish_reason

    # ---- prompt and logprobs -----------------------------------------------------------
    def _prompt_text(self, choice: Choice) -> str:
        texts = self.req.prompt_texts
        text = texts[choice.prompt_index] if choice.prompt_index < len(texts) else None
        if text is None:
            text = self._tokenizer.decode(choice.prompt_token_ids, skip_special_tokens=False)
        return text

    def _scores_of(self, choice: Choice) -> PromptScores:
        scores = self._scores.get(choice.prompt_index)
        return scores if scores is not None else [None] * len(choice.prompt_token_ids)

    def _echo_scores(self, choice: Choice) -> list[TokenLogprob | None]:
        return list(self._scores_of(choice)) if self.req.params.logprobs is not None else []

    def _prompt_logprobs(self, choice: Choice) -> list[dict[str, Any] | None]:
        return self._format.prompt(self._scores_of(choice), self.req.prompt_logprobs or 0)

    def _completion_logprobs(
        self, token_ids: list[int], logprobs: list[TokenLogprob | None], offset: int
    ) -> dict[str, Any] | None:
        k = self.req.params.logprobs
        if k is None or not logprobs:
            return None
        # Each token has its log-prob (echoed prompt tokens too), so both lists end together.
        ids = token_ids[len(token_ids) - len(logprobs) :]
        return self._format.completion(ids, logprobs, offset, k)

    def _chat_logprobs(self, logprobs: list[TokenLogprob]) -> dict[str, Any] | None:
        if self.req.params.logprobs is None or not logprobs:
            return None
        return self._format.chat(logprobs)


def _call_deltas(index: int, call: ToolCall) -> list[dict[str, Any]]:
    opening = {**call.as_openai(), "index": index}
    opening["function"] = {"name": call.name, "arguments": ""}
    return [
        {"tool_calls": [opening]},
        {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]},
    ]


def _role_delta() -> dict[str, Any]:
    return {"role": "assistant", "content": ""}
