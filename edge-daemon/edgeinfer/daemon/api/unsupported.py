"""Request fields the daemon does not serve and that would change what is generated.

Unknown fields are ignored, as vLLM does (clients send vendor extras), but a field that is
known and would change the tokens or their meaning must not be dropped silently: the client
would get a 200 with an answer it did not ask for. Each such field, when set to anything but
its neutral value (null; false or [] where the field is a flag or a list), is a 400 naming
it; the OpenAPI document states the same. Structured outputs and tool calls are parsed elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from edgeinfer.daemon.api.errors import APIError


def _not_null(value: Any) -> bool:
    return value is not None


def _not_null_or_false(value: Any) -> bool:
    return value is not None and value is not False


def _not_null_or_empty(value: Any) -> bool:
    return value is not None and value != []


def _not_text_only(value: Any) -> bool:
    return value is not None and value != ["text"]


# field -> (whether the value asks for something, why it is refused)
_COMMON: dict[str, tuple[Callable[[Any], bool], str]] = {
    "use_beam_search": (_not_null_or_false, "beam search is not supported"),
    "allowed_token_ids": (_not_null_or_empty, "allowed_token_ids is not supported; use logit_bias"),
    "bad_words": (_not_null_or_empty, "bad_words is not supported; use logit_bias"),
    "logits_processors": (_not_null, "logits_processors are not supported"),
    "truncate_prompt_tokens": (_not_null, "truncate_prompt_tokens is not supported"),
}
_BY_KIND: dict[str, dict[str, tuple[Callable[[Any], bool], str]]] = {
    "completion": {
        "suffix": (_not_null, "suffix is not supported"),
    },
    "chat": {
        "echo": (_not_null_or_false, "echo is supported on /v1/completions only"),
        "function_call": (_not_null, "function_call (legacy functions) is not supported"),
        "audio": (_not_null, "audio output is not supported"),
        "modalities": (_not_text_only, "only the text modality is supported"),
        "web_search_options": (_not_null, "web search is not supported"),
    },
}


def refuse_unsupported(kind: str, body: dict[str, Any]) -> None:
    """A 400 naming the first field set that this daemon cannot honour (``kind``:
    "completion" or "chat")."""
    for table in (_COMMON, _BY_KIND[kind]):
        for name, (asks, why) in table.items():
            if asks(body.get(name)):
                raise APIError(400, why, param=name)
