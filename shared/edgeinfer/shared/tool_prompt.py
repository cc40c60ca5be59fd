"""How a chat request's tools reach the prompt: one implementation for the daemon that prefills
it and the router that predicts its block keys (the rendered text decides both).

Templates that know tools (their source mentions ``tools``) get them as transformers passes
them: ``tools=``, assistant ``tool_calls`` with the arguments as objects, ``tool`` messages.
Templates that do not (the built-in model's, the tiny test model's) get the tools as a Hermes
block in the system message, past calls as ``<tool_call>`` text and tool results as
``<tool_response>`` user turns, as Qwen's template writes them.

The messages are the daemon's validated ones (text parts joined, tool calls well formed).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from edgeinfer.shared.chat_template import ChatTemplate, template_source

# How Qwen 2.5's template introduces tools; small models trained on ChatML follow it best.
HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def has_tool_history(messages: Iterable[Any]) -> bool:
    """Whether a conversation holds tool results or past calls (they change the rendering
    even when the request lists no tools)."""
    return any(
        isinstance(m, dict) and (m.get("role") == "tool" or bool(m.get("tool_calls")))
        for m in messages
    )


def renders_tools(template: ChatTemplate | None, tools: list[dict[str, Any]]) -> bool:
    """Whether the template that will render the request writes tools itself."""
    return "tools" in template_source(template, tools or None)


def present_tools(
    chat: list[dict[str, Any]], tools: list[dict[str, Any]], native: bool
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and extra template arguments that present ``tools`` (each
    ``{"type": "function", "function": {...}}``) and the tool history to the template."""
    if native:
        extra = {"tools": tools} if tools else {}
        return [_with_argument_objects(m) for m in chat], extra
    out: list[dict[str, Any]] = []
    for m in chat:
        if m["role"] == "tool":
            text = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("_tool_turn"):
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text, "_tool_turn": True})
            continue
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [
                "<tool_call>\n"
                + json.dumps({"name": c["function"]["name"], "arguments": _arguments(c)})
                + "\n</tool_call>"
                for c in m["tool_calls"]
            ]
            text = "\n".join([m["content"], *calls] if m.get("content") else calls)
            m = {"role": "assistant", "content": text}
        out.append(m)
    out = [{k: v for k, v in m.items() if k != "_tool_turn"} for m in out]
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        block = HERMES_SYSTEM.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{block}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out, {}


def _with_argument_objects(message: dict[str, Any]) -> dict[str, Any]:
    # Templates write the arguments with tojson: they expect an object, not OpenAI's string.
    if not message.get("tool_calls"):
        return message
    calls = [
        {**c, "function": {**c["function"], "arguments": _arguments(c)}}
        for c in message["tool_calls"]
    ]
    return {**message, "tool_calls": calls}


def _arguments(call: dict[str, Any]) -> Any:
    args = call["function"].get("arguments")
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args if args is not None else {}
