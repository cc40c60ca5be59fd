"""A chat request's tools: validation, how they reach the prompt, and the forced-call grammar.

``tool_choice``: ``none`` (the model sees the tools but its answer is not read for calls),
``auto`` (free generation, calls parsed out of it), ``required`` or a named function (the
call is forced by a grammar in the model's own format, arguments valid for the schema).

How the tools reach the prompt is :mod:`edgeinfer.shared.tool_prompt` (the router renders
with the same code): as transformers passes them to templates that know tools, else as a
Hermes block in the system message, the answer then read with the Hermes parser.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from edgeinfer.daemon.api.errors import APIError
from edgeinfer.daemon.api.tool_parsers import PARSERS, ToolCallParser, detect_format
from edgeinfer.daemon.engine.errors import InvalidRequestError
from edgeinfer.daemon.engine.structured import StructuredSpec
from edgeinfer.daemon.engine.structured.tool_grammar import (
    MISTRAL_MARKER,
    NO_PARAMETERS,
    check_parameters_schema,
    tool_call_spec,
)
from edgeinfer.daemon.engine.tokenizer import Tokenizer
from edgeinfer.shared.chat_template import ChatTemplateError, template_source
from edgeinfer.shared.tool_prompt import has_tool_history, present_tools

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's validated tools (None when it has none and calls none)."""

    tools: list[dict[str, Any]]  # as OpenAI writes them, for the template
    choice: str  # none | auto | required | function
    function: str | None  # the function a "function" choice forces
    parallel: bool
    parser: ToolCallParser
    native: bool  # the template renders tools itself
    forced: StructuredSpec | None  # the grammar when a call is required

    @property
    def parses(self) -> bool:
        return self.choice != "none" and bool(self.tools)


def parse_tools(
    body: dict[str, Any], tokenizer: Tokenizer, parser_name: str | None
) -> ToolRequest | None:
    """The request's tools, or None when it has none and no tool messages; a 400 naming the
    field for an invalid tool, a ``tool_choice`` naming no tool, or a contradiction."""
    raw = body.get("tools")
    tools = _tools(raw) if raw is not None else []
    choice, function = _choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls")
    parallel = True if parallel is None else parallel
    if not isinstance(parallel, bool):
        raise APIError(400, "parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    if not tools and not has_tool_history(body.get("messages") or ()):
        return None
    try:
        source = template_source(tokenizer.chat_template, tools or None)
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), param="messages") from exc
    fmt = parser_name or detect_format(source)
    forced = None
    if choice in ("required", "function"):
        funcs = [
            (t["function"]["name"], t["function"].get("parameters") or NO_PARAMETERS)
            for t in tools
            if function is None or t["function"]["name"] == function
        ]
        marker = tokenizer.token_to_id(MISTRAL_MARKER) if fmt == "mistral" else None
        try:
            forced = tool_call_spec(fmt, funcs, parallel and choice == "required", marker)
        except InvalidRequestError as exc:
            raise APIError.invalid(exc) from exc
    native = "tools" in source
    return ToolRequest(tools, choice, function, parallel, PARSERS[fmt](), native, forced)


def render_messages(
    chat: list[dict[str, Any]], tools: ToolRequest | None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and extra template arguments that present ``tools`` to the template."""
    if tools is None:
        return chat, {}
    return present_tools(chat, tools.tools, tools.native)


def check_tool_history(message: dict[str, Any], where: str) -> None:
    """A 400 unless an assistant's ``tool_calls`` and a ``tool`` message are well formed."""
    calls = message.get("tool_calls")
    if calls is not None:
        if message["role"] != "assistant" or not isinstance(calls, list):
            param = f"{where}.tool_calls"
            raise APIError(400, f"{param} must be an assistant's list", param=param)
        for j, c in enumerate(calls):
            _check_past_call(c, f"{where}.tool_calls[{j}]")
    call_id = message.get("tool_call_id")
    if call_id is not None and not isinstance(call_id, str):
        param = f"{where}.tool_call_id"
        raise APIError(400, f"{param} must be a string", param=param)
    if message["role"] == "tool" and call_id is None:
        raise APIError(400, f"{where} (a tool message) needs a tool_call_id", param=where)


def _check_past_call(call: Any, where: str) -> None:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise APIError(400, f"{where} needs a function with a name", param=where)
    for key, value in (("id", call.get("id")), ("function.arguments", fn.get("arguments"))):
        if value is not None and not isinstance(value, str):
            param = f"{where}.{key}"
            raise APIError(400, f"{param} must be a string", param=param)
    if call.get("type", "function") != "function":
        raise APIError(400, f"{where}.type must be 'function'", param=f"{where}.type")


def _tools(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise APIError(400, "tools must be a list of function tools", param="tools")
    seen: set[str] = set()
    tools = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise APIError(400, f"{where}.type must be 'function'", param=f"{where}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise APIError(400, f"{where}.function must be an object", param=f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            param = f"{where}.function.name"
            raise APIError(400, f"{param} must be 1-64 of [A-Za-z0-9_-]", param=param)
        if name in seen:
            param = f"{where}.function.name"
            raise APIError(400, f"{param}: the function {name!r} is defined twice", param=param)
        seen.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            param = f"{where}.function.description"
            raise APIError(400, f"{param} must be a string", param=param)
        if fn.get("parameters") is not None:
            try:
                check_parameters_schema(fn["parameters"], f"{where}.function.parameters")
            except InvalidRequestError as exc:
                raise APIError.invalid(exc) from exc
        tools.append({"type": "function", "function": fn})
    return tools


def _choice(raw: Any, tools: list[dict[str, Any]]) -> tuple[str, str | None]:
    if raw is None:
        return ("auto" if tools else "none"), None
    if isinstance(raw, str):
        if raw not in _CHOICES:
            raise APIError(
                400, f"tool_choice must be one of {_CHOICES} or a function", param="tool_choice"
            )
        if raw != "none" and not tools:
            raise APIError(400, f"tool_choice {raw!r} needs tools", param="tool_choice")
        return raw, None
    fn = raw.get("function") if isinstance(raw, dict) and raw.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise APIError(
            400,
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if name not in {t["function"]["name"] for t in tools}:
        raise APIError(
            400, f"tool_choice names {name!r}, which is not in tools", param="tool_choice"
        )
    return "function", name
