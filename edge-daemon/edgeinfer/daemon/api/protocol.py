"""Parse and validate OpenAI completion and chat-completion requests.

Like vLLM, unknown fields are ignored (clients send vendor extras) but a known field of the
wrong type or value is a 400 naming it. Sampling fields are handed to :class:`SamplingParams`
as they came, since it already checks their types and ranges; this module checks the fields it
interprets itself and the prompt's length, so that every refusal happens before a streaming
response has sent its headers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import orjson

from edgeinfer.daemon.api.errors import APIError
from edgeinfer.daemon.api.fields import Fields, parse_prefill_endpoint
from edgeinfer.daemon.engine.errors import InvalidRequestError
from edgeinfer.daemon.engine.sampling_params import SamplingParams
from edgeinfer.daemon.engine.tokenizer import Tokenizer

Kind = Literal["completion", "chat"]

# OpenAI's documented default for /v1/completions.
DEFAULT_COMPLETION_MAX_TOKENS = 16

# Request fields passed straight to SamplingParams (which validates them).
_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "include_stop_str_in_output",
    "skip_special_tokens",
)


@dataclass(frozen=True)
class ModelInfo:
    """What request validation needs to know about the served model."""

    name: str
    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int
    kv_capacity_tokens: int  # the most tokens one request can hold in the KV cache


@dataclass(frozen=True)
class GenerateRequest:
    """A validated request: one engine request per prompt, one choice per prompt."""

    kind: Kind
    prompts: list[list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool
    prefill_endpoint: str | None


def load_json(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def parse_request(
    kind: Kind, body: dict[str, Any], model: ModelInfo, prefill_header: str | None
) -> GenerateRequest:
    f = Fields(body)
    name = f.text("model")
    if name is not None and name != model.name:
        raise APIError(
            404,
            f"The model `{name}` does not exist.",
            param="model",
            code="model_not_found",
        )
    if f.integer("n", 1) != 1:
        raise APIError(400, "n must be 1: one choice per prompt", param="n")
    stream = f.flag("stream", False)
    options = f.object("stream_options")
    if options is not None and not stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream")
    include_usage = Fields(options or {}, "stream_options.").flag("include_usage", False)
    endpoint = parse_prefill_endpoint(prefill_header, f.object("kv_transfer_params"))
    return_token_ids = f.flag("return_token_ids", False)
    sampling = {k: body[k] for k in _SAMPLING_FIELDS if body.get(k) is not None}

    if kind == "completion":
        if f.flag("echo", False):
            raise APIError(400, "echo is not supported", param="echo")
        if f.integer("best_of", 1) != 1:
            raise APIError(400, "best_of must be 1", param="best_of")
        if body.get("suffix") is not None:
            raise APIError(400, "suffix is not supported", param="suffix")
        prompts = _completion_prompts(body.get("prompt"), model)
        logprobs = f.integer("logprobs", None)
        max_tokens = body.get("max_tokens")
        if max_tokens is None:
            max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
        prompt_param = "prompt"
    else:
        for unsupported in ("tools", "functions"):
            if body.get(unsupported):
                raise APIError(400, f"{unsupported} are not supported", param=unsupported)
        fmt = f.object("response_format")
        if fmt is not None and fmt.get("type", "text") != "text":
            raise APIError(
                400, "only response_format type 'text' is supported", param="response_format"
            )
        prompts = [_chat_prompt(f, model)]
        logprobs = None
        top_logprobs = f.integer("top_logprobs", None)
        if f.flag("logprobs", False):
            logprobs = 0 if top_logprobs is None else top_logprobs
        elif top_logprobs:
            raise APIError(400, "top_logprobs needs logprobs to be true", param="top_logprobs")
        max_tokens = body.get("max_completion_tokens")
        if max_tokens is None:
            max_tokens = body.get("max_tokens")
        if max_tokens is None:
            # vLLM's default for chat: whatever room the context leaves.
            room = min(model.max_model_len, model.kv_capacity_tokens) - len(prompts[0])
            max_tokens = max(room, 1)
        prompt_param = "messages"
    if logit_bias := body.get("logit_bias"):
        raise APIError(400, f"logit_bias is not supported (got {len(logit_bias)} entries)")

    try:
        params = SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **sampling)
    except InvalidRequestError as exc:
        raise APIError.invalid(exc) from exc
    for ids in prompts:
        _check_length(len(ids), params.max_tokens, model, prompt_param)
    return GenerateRequest(
        kind=kind,
        prompts=prompts,
        params=params,
        stream=stream,
        include_usage=include_usage,
        return_token_ids=return_token_ids,
        prefill_endpoint=endpoint,
    )


def _completion_prompts(prompt: Any, model: ModelInfo) -> list[list[int]]:
    """A string, a list of strings, a list of token ids, or a list of such lists."""

    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and all(type(t) is int for t in x)

    if isinstance(prompt, str):
        raw: list[Any] = [prompt]
    elif is_ids(prompt) and prompt:
        raw = [prompt]
    elif (
        isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt)
    ):
        raw = prompt
    else:
        raise APIError(
            400,
            "prompt must be a string, a list of strings, a list of token ids or a list of "
            "token-id lists",
            param="prompt",
        )
    prompts = [model.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in raw]
    for ids in prompts:
        if any(not 0 <= t < model.vocab_size for t in ids):
            raise APIError(
                400, f"prompt token ids must be in [0, {model.vocab_size})", param="prompt"
            )
    return prompts


def _chat_prompt(f: Fields, model: ModelInfo) -> list[int]:
    messages = f.body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list", param="messages")
    chat = [_chat_message(m, i) for i, m in enumerate(messages)]
    extra = f.object("chat_template_kwargs") or {}
    add_generation_prompt = f.flag("add_generation_prompt", True)
    try:
        text = model.tokenizer.apply_chat_template(
            chat, add_generation_prompt=add_generation_prompt, **extra
        )
    except InvalidRequestError as exc:
        raise APIError.invalid(exc) from exc
    # The template already wrote any special tokens it wants (vLLM does the same).
    return model.tokenizer.encode(text, add_special_tokens=False)


def _chat_message(message: Any, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise APIError(400, f"{where} must be an object with a string 'role'", param=where)
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise APIError(400, f"{where}: only text content parts are supported", param=where)
            if not isinstance(part.get("text"), str):
                raise APIError(400, f"{where}: a text part needs a string 'text'", param=where)
            texts.append(part["text"])
        content = "\n".join(texts)
    elif content is not None and not isinstance(content, str):
        raise APIError(400, f"{where}.content must be a string or a list of parts", param=where)
    return {**message, "content": content}


def _check_length(n: int, max_tokens: int, model: ModelInfo, prompt_param: str) -> None:
    if n == 0:
        raise APIError(400, "the prompt is empty", param=prompt_param)
    limit = model.max_model_len
    if n >= limit or n + max_tokens > limit:
        # OpenAI's wording, which clients and users recognise.
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{n + max_tokens} tokens ({n} in the {prompt_param}, {max_tokens} in the "
            "completion). Please reduce the length of the prompt or completion.",
            param=prompt_param if n >= limit else "max_tokens",
            code="context_length_exceeded",
        )
    if n + max_tokens > model.kv_capacity_tokens:
        raise APIError(
            400,
            f"the request needs {n + max_tokens} tokens of KV cache but this daemon holds at "
            f"most {model.kv_capacity_tokens} per request",
            param="max_tokens",
        )
