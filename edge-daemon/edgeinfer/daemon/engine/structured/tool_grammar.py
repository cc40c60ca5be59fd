"""Grammars that force a tool call in the model's own format, arguments valid for the schema.

``tool_choice: "required"`` or a named function becomes a Lark grammar (llguidance's dialect,
where ``%json {schema}`` embeds a JSON schema): the model writes exactly its family's call
syntax (Hermes ``<tool_call>`` blocks, Llama 3 JSON, Mistral ``[TOOL_CALLS]``), so what it
writes is what it was trained on, and the response's tool parser reads it back unchanged.
The grammar is an ordinary ``grammar`` constraint: it is cached, and it travels to a prefill
daemon like any other, so the first token already obeys it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal, get_args

import llguidance

from edgeinfer.daemon.engine.errors import InvalidRequestError
from edgeinfer.daemon.engine.structured.spec import StructuredSpec

ToolFormat = Literal["hermes", "llama3_json", "mistral"]
TOOL_FORMATS: tuple[str, ...] = get_args(ToolFormat)
MISTRAL_MARKER = "[TOOL_CALLS]"
# The spacing models write JSON with, as for json_schema constraints (no free whitespace).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# A function declared without parameters takes none.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def check_parameters_schema(schema: Any, param: str) -> None:
    """Raise :class:`InvalidRequestError` naming ``param`` unless ``schema`` is a JSON schema
    the grammar engine accepts (so ``auto`` requests are checked as strictly as forced ones)."""
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{param} must be a JSON schema object", param=param)
    try:
        grammar = llguidance.grammar_from("json", json.dumps(schema))
    except ValueError as exc:
        raise InvalidRequestError(f"{param}: {exc}", param=param) from exc
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidRequestError(f"{param}: {error}", param=param)


def tool_call_spec(
    fmt: str,
    functions: Sequence[tuple[str, Mapping[str, Any]]],
    parallel: bool,
    marker_token_id: int | None = None,
) -> StructuredSpec:
    """The constraint forcing one call (or, with ``parallel``, one or more) to one of
    ``functions`` ((name, parameters schema) pairs) in format ``fmt``. ``marker_token_id``:
    the id of Mistral's ``[TOOL_CALLS]`` when it is a special token of the vocabulary."""
    if fmt not in TOOL_FORMATS:
        raise InvalidRequestError(f"unknown tool-call format {fmt!r}", param="tool_choice")
    rules = [f"call: {' | '.join(f'c{i}' for i in range(len(functions)))}"]
    for i, (name, schema) in enumerate(functions):
        key = "parameters" if fmt == "llama3_json" else "arguments"
        head = f'{{"name": {json.dumps(name)}, "{key}": '
        options = {**schema, "x-guidance": _JSON_OPTIONS}
        before, after = (
            (f"<tool_call>\n{head}", "}\n</tool_call>") if fmt == "hermes" else (head, "}")
        )
        rules.append(f"c{i}: {_lit(before)} a{i} {_lit(after)}")
        rules.append(f"a{i}: %json {json.dumps(options, ensure_ascii=False)}")
    if fmt == "hermes":
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
    elif fmt == "llama3_json":
        start = 'start: call ("; " call)*' if parallel else "start: call"
    else:
        marker = f"<[{marker_token_id}]>" if marker_token_id is not None else _lit(MISTRAL_MARKER)
        calls = 'call (", " call)*' if parallel else "call"
        start = f'start: {marker} "[" {calls} "]"'
    lark = "\n".join(["%llguidance {}", start, *rules]) + "\n"
    return StructuredSpec("grammar", lark, "tool_choice")


def _lit(text: str) -> str:
    # JSON string escapes are Lark's too.
    return json.dumps(text, ensure_ascii=False)
