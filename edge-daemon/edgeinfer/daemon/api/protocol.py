"""Parse and validate OpenAI completion and chat-completion requests.

Like vLLM, unknown fields are ignored (clients send vendor extras) but a known field of the
wrong type or value is a 400 naming it. Sampling fields are handed to :class:`SamplingParams`
as they came, since it already checks their types and ranges; this module checks the fields it
interprets itself and the prompt's length, so that every refusal happens before a streaming
response has sent its headers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from edgeinfer.daemon.api.cache_salt import body_cache_salt
from edgeinfer.daemon.api.errors import APIError
from edgeinfer.daemon.api.fields import Fields
from edgeinfer.daemon.api.prompt_length import check_chat, encode_within, too_long
from edgeinfer.daemon.api.structured import parse_structured
from edgeinfer.daemon.api.tools import ToolRequest, check_tool_history, parse_tools, render_messages
from edgeinfer.daemon.api.unsupported import refuse_unsupported
from edgeinfer.daemon.engine.errors import InvalidRequestError
from edgeinfer.daemon.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from edgeinfer.daemon.engine.tokenizer import Tokenizer

Kind = Literal["completion", "chat"]

# OpenAI's documented default for /v1/completions.
DEFAULT_COMPLETION_MAX_TOKENS = 16
# Choices per prompt: each one is a sequence in the running batch.
MAX_N = 16

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
    tool_call_parser: str | None = None  # None: the format the chat template shows


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
    cache_salt: str | None = None  # the body's part; the handler adds the router's header
    n: int = 1  # choices per prompt; choice index = prompt index * n + i
    # The prompt as the client wrote it (None: token ids, echoed decoded).
    prompt_texts: tuple[str | None, ...] = ()
    echo: bool = False  # completions: each choice's text starts with its prompt
    # max_tokens 0 (with echo or prompt_logprobs): score the prompt, return no token. The
    # engine still samples one, which the response leaves out.
    prompt_only: bool = False
    prompt_logprobs: int | None = None  # vLLM's field, as the client asked it
    continuous_usage: bool = False  # stream_options.continuous_usage_stats
    tools: ToolRequest | None = None  # chat: the tools, and how to read calls back

    def choice_params(self, i: int) -> SamplingParams:
        """Choice ``i``'s parameters: its own seed (seed + i), and only choice 0 scores the
        prompt (the others copy its scores and reuse its cached blocks)."""
        seed = self.params.seed
        if seed is not None:
            seed = (seed + i + 2**63) % 2**64 - 2**63  # stays a valid int64
        prompt_logprobs = self.params.prompt_logprobs if i == 0 else None
        return dataclasses.replace(self.params, seed=seed, prompt_logprobs=prompt_logprobs)


def check_model(f: Fields, model: ModelInfo) -> None:
    """404 for a body naming another model than the one served."""
    name = f.text("model")
    if name is not None and name != model.name:
        raise APIError(
            404,
            f"The model `{name}` does not exist.",
            param="model",
            code="model_not_found",
        )


def parse_request(
    kind: Kind, body: dict[str, Any], model: ModelInfo, prefill_endpoint: str | None
) -> GenerateRequest:
    """Validate ``body`` and tokenise its prompts; ``prefill_endpoint`` is the one the caller
    may name (:func:`~edgeinfer.daemon.api.caller.trusted_prefill_endpoint`). CPU-bound with
    long prompts: the handlers run it on the tokenize pool, off the event loop."""
    f = Fields(body)
    check_model(f, model)
    refuse_unsupported(kind, body)
    structured = parse_structured(body)
    n = f.integer("n", 1)
    if not 1 <= n <= MAX_N:
        raise APIError(400, f"n must be in [1, {MAX_N}], got {n}", param="n")
    stream = f.flag("stream", False)
    options = f.object("stream_options")
    if options is not None and not stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream")
    stream_fields = Fields(options or {}, "stream_options.")
    include_usage = stream_fields.flag("include_usage", False)
    continuous_usage = stream_fields.flag("continuous_usage_stats", False)
    prompt_logprobs = f.integer("prompt_logprobs", None)
    if prompt_logprobs is not None and not 0 <= prompt_logprobs <= MAX_LOGPROBS:
        raise APIError(
            400, f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]", param="prompt_logprobs"
        )
    echo = False
    prompt_texts: tuple[str | None, ...] = ()
    return_token_ids = f.flag("return_token_ids", False)
    cache_salt = body_cache_salt(f)
    sampling = {k: body[k] for k in _SAMPLING_FIELDS if body.get(k) is not None}

    tools: ToolRequest | None = None
    if kind == "completion":
        echo = f.flag("echo", False)
        best_of = f.integer("best_of", None)
        if best_of is not None and best_of != n:
            # best_of > n would pick the likeliest choices server-side: not done here.
            raise APIError(400, f"best_of must equal n ({n}), got {best_of}", param="best_of")
        prompts, prompt_texts = _completion_prompts(
            body.get("prompt"), model, f.flag("add_special_tokens", True)
        )
        logprobs = f.integer("logprobs", None)
        max_tokens = body.get("max_tokens")
        if max_tokens is None:
            max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
        prompt_param = "prompt"
    else:
        if body.get("functions"):
            raise APIError(
                400, "functions (legacy) are not supported; use tools", param="functions"
            )
        tools = parse_tools(body, model.tokenizer, model.tool_call_parser)
        if tools is not None and tools.forced is not None:
            if structured is not None:
                raise APIError(
                    400,
                    f"{structured.param} cannot be combined with a forced tool_choice",
                    param="tool_choice",
                )
            structured = tools.forced
        if tools is not None and tools.parses and tools.parser.name == "mistral":
            # Its [TOOL_CALLS] marker is a special token: the parser must see it.
            sampling.setdefault("skip_special_tokens", False)
        prompts = [_chat_prompt(f, model, tools)]
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
    if logit_bias := f.object("logit_bias"):
        sampling["logit_bias"] = _logit_bias(logit_bias, model.vocab_size)
    # max_tokens 0 scores the prompt only (how evaluation harnesses ask for loglikelihoods).
    prompt_only = max_tokens == 0 and type(max_tokens) is int and kind == "completion"
    if prompt_only and not echo and prompt_logprobs is None:
        raise APIError(
            400, "max_tokens may be 0 only with echo or prompt_logprobs", param="max_tokens"
        )
    # Echoed prompt tokens carry logprobs when logprobs are asked: the engine scores the
    # prompt at the larger of the two widths, and each part of the answer keeps its own.
    scored = [k for k in (prompt_logprobs, logprobs if echo else None) if k is not None]
    try:
        params = SamplingParams(
            max_tokens=1 if prompt_only else max_tokens,
            logprobs=logprobs,
            prompt_logprobs=max(scored) if scored else None,
            structured=structured,
            **sampling,
        )
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
        prefill_endpoint=prefill_endpoint,
        cache_salt=cache_salt,
        n=n,
        prompt_texts=prompt_texts,
        echo=echo,
        prompt_only=prompt_only,
        prompt_logprobs=prompt_logprobs,
        continuous_usage=continuous_usage,
        tools=tools,
    )


def _logit_bias(bias: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """OpenAI's map of token id (a string key) -> bias; the values' range is SamplingParams'."""
    for key in bias:
        if not (key.isascii() and key.isdigit()) or not 0 <= int(key) < vocab_size:
            raise APIError(
                400,
                f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}",
                param="logit_bias",
            )
    return bias


def _completion_prompts(
    prompt: Any, model: ModelInfo, add_special_tokens: bool = True
) -> tuple[list[list[int]], tuple[str | None, ...]]:
    """A string, a list of strings, a list of token ids, or a list of such lists; returns the
    token ids and each prompt's text (None for token ids)."""

    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and all(type(t) is int for t in x)

    if isinstance(prompt, list) and len(prompt) >= model.max_model_len and type(prompt[0]) is int:
        # Refused on its length alone, before every id is looked at.
        raise too_long(model.max_model_len, len(prompt), "prompt")
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
    prompts = [
        encode_within(
            model.tokenizer, p, model.max_model_len, "prompt", add_special_tokens=add_special_tokens
        )
        if isinstance(p, str)
        else list(p)
        for p in raw
    ]
    for ids in prompts:
        if any(not 0 <= t < model.vocab_size for t in ids):
            raise APIError(
                400, f"prompt token ids must be in [0, {model.vocab_size})", param="prompt"
            )
    return prompts, tuple(p if isinstance(p, str) else None for p in raw)


# What the template call itself passes; chat_template_kwargs may not name them again.
_TEMPLATE_ARGUMENTS = frozenset({"messages", "add_generation_prompt"})


def chat_prompt_ids(body: dict[str, Any], model: ModelInfo) -> list[int]:
    """A chat body's prompt as generation prefills it (``messages``, ``add_generation_prompt``,
    ``chat_template_kwargs``); for ``/tokenize``."""
    tools = parse_tools(body, model.tokenizer, model.tool_call_parser)
    return _chat_prompt(Fields(body), model, tools)


def chat_renderer(
    f: Fields, model: ModelInfo, tools: ToolRequest | None
) -> tuple[list[dict[str, Any]], Callable[[list[dict[str, Any]]], str]]:
    """A chat body's messages as the template takes them, and the template call that renders
    them as generation will (``add_generation_prompt``, ``chat_template_kwargs``, tools)."""
    messages = f.body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list", param="messages")
    chat, tool_args = render_messages([_chat_message(m, i) for i, m in enumerate(messages)], tools)
    extra = {**(f.object("chat_template_kwargs") or {}), **tool_args}
    for reserved in _TEMPLATE_ARGUMENTS.intersection(extra):
        param = f"chat_template_kwargs.{reserved}"
        raise APIError(400, f"{param} is not allowed: the request sets it", param=param)
    add_generation_prompt = f.flag("add_generation_prompt", True)

    def render(messages: list[dict[str, Any]]) -> str:
        return model.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, **extra
        )

    return chat, render


def _chat_prompt(f: Fields, model: ModelInfo, tools: ToolRequest | None) -> list[int]:
    chat, render = chat_renderer(f, model, tools)
    try:
        check_chat(model.tokenizer, chat, model.max_model_len, render)
        text = render(chat)
    except InvalidRequestError as exc:
        raise APIError.invalid(exc) from exc
    # The template already wrote any special tokens it wants (vLLM does the same).
    return encode_within(
        model.tokenizer, text, model.max_model_len, "messages", add_special_tokens=False
    )


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
    check_tool_history(message, where)
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
