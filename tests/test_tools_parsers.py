"""Tool-call parsers and grammars, without a model: each family's format read back whole and
streamed in arbitrary pieces, text that only looks like a call, and format detection."""

from __future__ import annotations

import json

import llguidance
import pytest
from tokenizers import Tokenizer

from edgeinfer.daemon.api.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ToolCallParser,
    ToolCallStream,
    detect_format,
)
from edgeinfer.daemon.engine.errors import InvalidRequestError
from edgeinfer.daemon.engine.structured.tool_grammar import (
    NO_PARAMETERS,
    check_parameters_schema,
    tool_call_spec,
)
from edgeinfer.daemon.engine.tiny_checkpoint import tokenizer_json

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
    "additionalProperties": False,
}
HERMES = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'
)
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; ' + (
    '{"name": "noop", "parameters": {}}'
)
MISTRAL = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ' + (
    '{"name": "noop", "arguments": {}}]'
)
CASES = [(HermesParser(), HERMES), (Llama3JsonParser(), LLAMA), (MistralParser(), MISTRAL)]


def expected(parser: ToolCallParser) -> list[tuple[str, dict[str, object]]]:
    return [("get_weather", {"city": "Paris"}), ("noop", {})]


@pytest.mark.parametrize(("parser", "text"), CASES)
def test_whole_answers(parser: ToolCallParser, text: str) -> None:
    content, calls = parser.extract(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == expected(parser)
    assert content == ("Let me check." if parser.name == "hermes" else None)
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id


@pytest.mark.parametrize(("parser", "text"), CASES)
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_in_pieces(parser: ToolCallParser, text: str, step: int) -> None:
    stream = ToolCallStream(parser)
    content = ""
    calls = []
    for i in range(0, len(text), step):
        piece, new = stream.feed(text[i : i + step])
        content += piece
        calls += new
        assert "<" not in piece and "[" not in piece, "a marker's start leaked as content"
    piece, new = stream.finish()
    content += piece
    calls += new
    assert [(c.name, json.loads(c.arguments)) for c in calls] == expected(parser)
    assert content.strip() == ("Let me check." if parser.name == "hermes" else "")


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        (HermesParser(), "I would write <tool_call> here but {not json"),
        (HermesParser(), "Just prose, with a < sign."),
        (Llama3JsonParser(), 'The answer is {"name": "x"} inline.'),
        (Llama3JsonParser(), "{not json at all"),
        (MistralParser(), "[TOOL_CALLS] nothing"),
    ],
)
def test_text_that_is_not_a_call_stays_content(parser: ToolCallParser, text: str) -> None:
    assert parser.extract(text) == (text, [])
    stream = ToolCallStream(parser)
    streamed = "".join(stream.feed(ch)[0] for ch in text) + stream.finish()[0]
    assert streamed == text and stream.calls == []


def test_an_unclosed_hermes_call_counts_at_the_end() -> None:
    _, calls = HermesParser().extract('<tool_call>\n{"name": "f", "arguments": {"a": 1}}')
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1}')]


def test_mistral_v11_form() -> None:
    _, calls = MistralParser().extract('[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Rome"})]


def test_detect_format() -> None:
    assert detect_format("{{ '<tool_call>' }}") == "hermes"
    assert detect_format("{{ '<|python_tag|>' }}") == "llama3_json"
    assert detect_format("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert detect_format("plain chatml") == "hermes"
    assert detect_format(None) == "hermes"


@pytest.mark.parametrize(("fmt", "text"), [("hermes", HERMES), ("llama3_json", LLAMA[14:])])
def test_grammars_accept_the_format_they_force(fmt: str, text: str) -> None:
    tok_json = tokenizer_json(512)
    tok = llguidance.LLTokenizer(tok_json, n_vocab=512)
    functions = [("get_weather", WEATHER), ("noop", NO_PARAMETERS)]
    text = text.removeprefix("Let me check.\n")

    def accepts(spec_text: str, parallel: bool) -> bool:
        spec = tool_call_spec(fmt, functions, parallel)
        matcher = llguidance.LLMatcher(tok, llguidance.grammar_from("grammar", spec.source))
        ids = Tokenizer.from_str(tok_json).encode(spec_text, add_special_tokens=False).ids
        return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()

    assert accepts(text, parallel=True)
    assert not accepts(text, parallel=False)  # two calls where one is allowed
    wrong = text.replace('"Paris"', "7")  # arguments that break the schema
    assert not accepts(wrong, parallel=True)


def test_bad_parameter_schemas_are_refused() -> None:
    with pytest.raises(InvalidRequestError) as err:
        check_parameters_schema({"type": "frob"}, "tools[0].function.parameters")
    assert err.value.param == "tools[0].function.parameters"
    with pytest.raises(InvalidRequestError):
        check_parameters_schema([1], "p")
    check_parameters_schema(WEATHER, "p")
