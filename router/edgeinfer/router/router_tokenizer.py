"""A request's token ids and block keys, computed by the router exactly as its daemon will.

The daemon serves ``GET /v1/tokenizer`` (tokenizer.json, chat template, special tokens, block
size and ``tokenizer_id``); the router builds a :class:`RouterTokenizer` from it and renders and
encodes a request the way the daemon's API does: a chat through the model's template
(:mod:`edgeinfer.shared.chat_template`, the engine's own code), its tools and tool history
presented as the daemon presents them (:mod:`edgeinfer.shared.tool_prompt`), encoded without
special tokens (the template wrote them); a completion prompt with them unless the body says
otherwise. The keys are the engine's chained block keys (:mod:`edgeinfer.shared.block_keys`)
under the salt the daemon will use: the router's per-tenant header combined with the body's
``cache_salt``. ``tool_choice`` changes no prompt (only the grammar of a forced call).

A body the daemon will reject (or that the router cannot read the same way) gives None: the
request is then placed without prefix knowledge and the daemon words the error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from edgeinfer.router.errors import RouterError
from edgeinfer.router.segment_cache import SegmentCache
from edgeinfer.shared.block_keys import chain_keys, effective_cache_salt
from edgeinfer.shared.chat_template import ChatTemplate, ChatTemplateError, render_chat
from edgeinfer.shared.tool_prompt import has_tool_history, present_tools, renders_tools

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
# What the daemon's chat handler passes to the template itself (chat_template_kwargs may not).
_TEMPLATE_ARGUMENTS = frozenset({"messages", "add_generation_prompt"})
_MAX_CACHE_SALT_CHARS = 256  # the daemon's limit: a longer body salt is a 400 there


@dataclasses.dataclass(frozen=True, slots=True)
class PromptText:
    """What to encode: the rendered text (or ids given as such) and how."""

    text: str | None
    ids: list[int] | None
    add_special_tokens: bool
    cache_salt: str | None  # the body's part of the salt


class RouterTokenizer:
    """One daemon tokenizer (by ``tokenizer_id``), as ``GET /v1/tokenizer`` described it."""

    def __init__(self, description: Mapping[str, Any]) -> None:
        try:
            self.tokenizer_id = str(description["tokenizer_id"])
            self.block_size = int(description["block_size"])
            self._tok = HFTokenizer.from_str(description["tokenizer_json"])
            template = description.get("chat_template")
            special = description.get("special_tokens") or {}
        except Exception as exc:  # a KeyError, a bad value, or the Rust library's plain Exception
            raise RouterError(f"unusable tokenizer description: {exc!r}") from exc
        if self.block_size < 1 or not isinstance(special, dict):
            raise RouterError("unusable tokenizer description: bad block_size or special_tokens")
        if template is not None and not isinstance(template, str | dict):
            raise RouterError("unusable tokenizer description: bad chat_template")
        self.chat_template: ChatTemplate | None = template
        self.segments = SegmentCache(self._tok)
        self.special_tokens: dict[str, str] = {str(k): str(v) for k, v in special.items()}

    def prompt_text(self, path: str, data: Any) -> PromptText | None:
        """The body's prompt, rendered (cheap except for the template), or None: the router
        cannot predict what the daemon will compute (or the daemon will refuse the body)."""
        if not isinstance(data, dict):
            return None
        salt = data.get("cache_salt")
        if salt is not None and not (
            isinstance(salt, str) and 0 < len(salt) <= _MAX_CACHE_SALT_CHARS
        ):
            return None
        if path == CHAT_PATH:
            text = self._chat_text(data)
            return None if text is None else PromptText(text, None, False, salt)
        if path == COMPLETIONS_PATH:
            return _completion_prompt(data, salt)
        return None

    def encode(
        self, prompt: PromptText, release_gil: bool = False, salt: str | None = None
    ) -> list[int]:
        """:meth:`encode_counted`'s ids."""
        return self.encode_counted(prompt, release_gil, salt)[0]

    def encode_counted(
        self, prompt: PromptText, release_gil: bool = False, salt: str | None = None
    ) -> tuple[list[int], int]:
        """Token ids. ``release_gil`` (on a worker thread): ``encode_batch``, which lets the
        event loop run meanwhile but hands the work to the library's thread pool; inline,
        ``encode`` in this thread (on a busy host the pool's wake-up costs milliseconds).
        A text the template rendered is encoded by its pieces, cached under ``salt`` (the
        effective cache salt, :mod:`edgeinfer.router.segment_cache`); the second value counts
        the ids that came from that cache."""
        if prompt.ids is not None:
            return prompt.ids, 0
        text, special = prompt.text or "", prompt.add_special_tokens
        if not special:
            return self.segments.encode_counted(text, salt, release_gil)
        if release_gil:
            return self._tok.encode_batch([text], add_special_tokens=special)[0].ids, 0
        return self._tok.encode(text, add_special_tokens=special).ids, 0

    def block_keys(self, ids: list[int], salt: str | None) -> list[bytes]:
        """The engine's keys for the full blocks of ``ids`` under the effective ``salt``
        (:meth:`salt`)."""
        return chain_keys(ids, self.block_size, salt)

    @staticmethod
    def salt(header_salt: str | None, prompt: PromptText) -> str | None:
        """The salt the daemon will combine: the router's per-tenant header and the body's."""
        return effective_cache_salt(header_salt, prompt.cache_salt)

    def _chat_text(self, data: dict[str, Any]) -> str | None:
        messages = data.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        chat = []
        for m in messages:
            message = _chat_message(m)
            if message is None:
                return None
            chat.append(message)
        extra = data.get("chat_template_kwargs") or {}
        if not isinstance(extra, dict):
            return None
        raw_tools = data.get("tools")
        tools = [] if raw_tools is None else _tools(raw_tools)
        if tools is None:
            return None
        add = data.get("add_generation_prompt", True)
        if not isinstance(add, bool):
            return None
        try:
            if tools or has_tool_history(chat):
                native = renders_tools(self.chat_template, tools)
                chat, tool_args = present_tools(chat, tools, native)
                extra = {**extra, **tool_args}
            if _TEMPLATE_ARGUMENTS.intersection(extra):
                return None
            return render_chat(self.chat_template, self.special_tokens, chat, add, **extra)
        except ChatTemplateError:
            return None


def _chat_message(message: Any) -> dict[str, Any] | None:
    """As the daemon reads a message: text parts joined by newlines, tool calls and results
    well formed; anything else unread."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        return None
    if not _tool_history_ok(message):
        return None
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                return None
            if not isinstance(part.get("text"), str):
                return None
            texts.append(part["text"])
        content = "\n".join(texts)
    elif content is not None and not isinstance(content, str):
        return None
    return {**message, "content": content}


def _tool_history_ok(message: dict[str, Any]) -> bool:
    """The daemon's checks on an assistant's ``tool_calls`` and a ``tool`` message."""
    calls = message.get("tool_calls")
    if calls is not None:
        if message["role"] != "assistant" or not isinstance(calls, list):
            return False
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                return False
            if not all(isinstance(v, str | None) for v in (call.get("id"), fn.get("arguments"))):
                return False
            if call.get("type", "function") != "function":
                return False
    call_id = message.get("tool_call_id")
    if call_id is not None and not isinstance(call_id, str):
        return False
    return message["role"] != "tool" or call_id is not None


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    """The tools as the daemon hands them to the template (its stricter checks refuse the
    rest: a name, a schema), or None where it refuses the list."""
    if not isinstance(raw, list):
        return None
    tools = []
    for tool in raw:
        if not isinstance(tool, dict) or tool.get("type") != "function":
            return None
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            return None
        tools.append({"type": "function", "function": fn})
    return tools


def _completion_prompt(data: dict[str, Any], salt: str | None) -> PromptText | None:
    add = data.get("add_special_tokens", True)
    if not isinstance(add, bool):
        return None
    prompt = data.get("prompt")
    # A batch of prompts: the first one's prefix stands for the request (they share a daemon).
    if isinstance(prompt, list) and prompt and not all(_is_id(t) for t in prompt):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return PromptText(prompt, None, add, salt)
    if isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt):
        return PromptText(None, list(prompt), add, salt)
    return None


def _is_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
