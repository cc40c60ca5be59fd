"""Tool calls read back out of generated text, one parser per model family's format.

* ``hermes`` (Hermes, Qwen 2/2.5/3, and the fallback format for templates without tools):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, repeated for parallel calls;
* ``llama3_json`` (Llama 3.1-3.3): the answer is ``{"name": ..., "parameters": {...}}``,
  possibly after ``<|python_tag|>``, several separated by ``;``;
* ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (or the newer
  ``[TOOL_CALLS]name[ARGS]{...}``).

:class:`ToolCallStream` turns a choice's text deltas into content deltas and finished calls:
text that may be the start of a call marker is held back until it is clearly not one.
Text that looks like a call but does not parse stays content, as vLLM does.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from edgeinfer.daemon.engine.structured.tool_grammar import MISTRAL_MARKER


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def _call(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args: Any = next((obj[k] for k in args_keys if k in obj), {})
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ToolCall(obj["name"], text)


def _json_objects(text: str, sep: str) -> tuple[list[Any], str]:
    """Complete JSON values from the start of ``text`` separated by ``sep``; and the rest."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    pos = 0
    while True:
        rest = text[pos:].lstrip()
        if values and rest.startswith(sep):
            rest = rest[len(sep) :].lstrip()
        try:
            value, end = decoder.raw_decode(rest)
        except ValueError:
            return values, text[pos:]
        values.append(value)
        pos = len(text) - len(rest) + end


class ToolCallParser:
    """Base: where calls start in the text, and the calls a text holds."""

    name = ""
    markers: tuple[str, ...] = ()

    def start(self, text: str) -> int | None:
        """Where the first call starts in ``text``, if it does."""
        found = [i for m in self.markers if (i := text.find(m)) >= 0]
        return min(found) if found else None

    def pending(self, text: str) -> int:
        """How many characters at the end of ``text`` (where no call started) might begin
        one, so a stream holds them back."""
        for n in range(min(len(text), max(map(len, self.markers))), 0, -1):
            if any(m.startswith(text[-n:]) for m in self.markers):
                return n
        return 0

    def calls(self, section: str, final: bool) -> list[ToolCall]:
        """The complete calls in ``section`` (the text from :meth:`start` on); ``final``: the
        text is whole, so a call the model left unclosed counts."""
        raise NotImplementedError

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """``(content, calls)`` of a whole answer; content None when empty."""
        i = self.start(text)
        calls = self.calls(text[i:], final=True) if i is not None else []
        if not calls:
            return text, []
        return text[:i].strip() or None, calls


class HermesParser(ToolCallParser):
    name = "hermes"
    markers = ("<tool_call>",)
    _CLOSED = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def calls(self, section: str, final: bool) -> list[ToolCall]:
        bodies = self._CLOSED.findall(section)
        tail = section[section.rfind("</tool_call>") + len("</tool_call>") :] if bodies else section
        if final and "<tool_call>" in tail:
            bodies.append(tail.split("<tool_call>", 1)[1])
        out = []
        for body in bodies:
            try:
                call = _call(json.loads(body))
            except ValueError:
                return []
            if call is None:
                return []
            out.append(call)
        return out


class Llama3JsonParser(ToolCallParser):
    name = "llama3_json"
    markers = ("<|python_tag|>", "{")

    def start(self, text: str) -> int | None:
        # Only an answer that opens with the call is one: a "{" later on is prose.
        stripped = text.lstrip()
        if stripped.startswith(self.markers):
            return len(text) - len(stripped)
        return None

    def pending(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or "<|python_tag|>".startswith(stripped):
            return len(text)
        return 0

    def calls(self, section: str, final: bool) -> list[ToolCall]:
        section = section.lstrip().removeprefix("<|python_tag|>")
        values, _ = _json_objects(section, ";")
        out = [_call(v, ("parameters", "arguments")) for v in values]
        return [c for c in out if c is not None] if all(out) else []


class MistralParser(ToolCallParser):
    name = "mistral"
    markers = (MISTRAL_MARKER,)

    def calls(self, section: str, final: bool) -> list[ToolCall]:
        out: list[ToolCall] = []
        for part in section.split(MISTRAL_MARKER)[1:]:
            part = part.strip()
            if part.startswith("["):
                values, _ = _json_objects(part, ",")
                if not values or not isinstance(values[0], list):
                    return []
                calls = [_call(v) for v in values[0]]
            else:  # name[ARGS]{...} (tokenizer v11 and later)
                name, _, args = part.partition("[ARGS]")
                values, _ = _json_objects(args, ",")
                calls = [ToolCall(name.strip(), json.dumps(values[0]))] if values else []
            if not calls or not all(calls):
                return []
            out.extend(c for c in calls if c is not None)
        return out


PARSERS: dict[str, type[ToolCallParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)
}


def detect_format(template: str | None) -> str:
    """The tool-call format a chat template teaches its model; Hermes when it shows none."""
    source = template or ""
    if MISTRAL_MARKER in source:
        return "mistral"
    if "<|python_tag|>" in source or "ipython" in source:
        return "llama3_json"
    return "hermes"


class ToolCallStream:
    """One streamed choice: text deltas in, content deltas and finished calls out."""

    def __init__(self, parser: ToolCallParser) -> None:
        self._parser = parser
        self._text = ""
        self._sent = 0  # characters of content sent
        self._section: int | None = None  # where the calls start
        self.calls: list[ToolCall] = []  # calls sent

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self._text += delta
        if self._section is None:
            self._section = self._parser.start(self._text)
        if self._section is None:
            end = len(self._text) - self._parser.pending(self._text)
            return self._content(end), []
        content = self._content(self._section)
        found = self._parser.calls(self._text[self._section :], final=False)
        return content, self._new(found)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left once the choice ended: held-back text, and calls closed by the end."""
        if self._section is None:
            return self._content(len(self._text)), []
        found = self._parser.calls(self._text[self._section :], final=True)
        if not found and not self.calls:
            # It looked like a call and was not one: it is content after all.
            return self._content(len(self._text)), []
        return "", self._new(found)

    def _content(self, end: int) -> str:
        piece = self._text[self._sent : end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return piece

    def _new(self, found: list[ToolCall]) -> list[ToolCall]:
        fresh = found[len(self.calls) :]
        self.calls.extend(fresh)
        return fresh
