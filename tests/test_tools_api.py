"""Tool calls over HTTP against the tiny model: forced calls (required, a named function) whose
arguments fit the schema, streamed deltas that add up to the whole answer, a history with
calls and results, and a 400 naming the field for every malformed tool request.

The tiny model's weights are random and its template knows no tools, so the calls come from
the Hermes fallback format and the grammar alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from daemon_helpers import build_checkpoint, daemon_config, read_events, start
from edgeinfer.daemon.api.protocol import ModelInfo, chat_prompt_ids, parse_request
from edgeinfer.daemon.config import DaemonConfig
from edgeinfer.daemon.engine.llm_engine import LLMEngine
from edgeinfer.daemon.engine.tokenizer import Tokenizer

pytestmark = pytest.mark.asyncio

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Rome", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
BAD_SCHEMA = {"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def chat(**extra: Any) -> dict[str, Any]:
    return {"messages": MESSAGES, "tools": [WEATHER, TIME], "max_tokens": 80, **extra}


def check_weather(call: dict[str, Any]) -> None:
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    args = json.loads(call["function"]["arguments"])
    assert args["city"] in ("Paris", "Rome", "Oslo") and 1 <= args["days"] <= 7


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("tools_api"))


def config(checkpoint: Path) -> DaemonConfig:
    # The tool listing alone is ~500 tokens of the tiny tokenizer: room for it and an answer.
    return daemon_config(checkpoint, max_model_len=2048, num_kv_blocks=192)


@pytest.fixture(scope="module")
def llm(checkpoint: Path) -> LLMEngine:
    return LLMEngine(config(checkpoint).to_engine_config())


@pytest_asyncio.fixture
async def client(aiohttp_client: Any, checkpoint: Path, llm: LLMEngine) -> Any:
    return await start(aiohttp_client, config(checkpoint), llm)


async def post(client: Any, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    resp = await client.post("/v1/chat/completions", json=body)
    return resp.status, await resp.json()


async def test_a_named_function_is_called_with_valid_arguments(client: Any) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        status, body = await post(client, chat(tool_choice=choice, temperature=1.0, seed=seed))
        assert status == 200, body
        answer = body["choices"][0]
        assert answer["finish_reason"] == "tool_calls"
        assert answer["message"]["content"] is None
        [call] = answer["message"]["tool_calls"]
        check_weather(call)


async def test_required_calls_one_of_the_tools(client: Any) -> None:
    status, body = await post(
        client, chat(tool_choice="required", parallel_tool_calls=False, temperature=0)
    )
    assert status == 200, body
    calls = body["choices"][0]["message"]["tool_calls"]
    assert len(calls) == 1 and calls[0]["function"]["name"] in ("get_weather", "get_time")
    json.loads(calls[0]["function"]["arguments"])


async def test_streamed_deltas_add_up_to_the_whole_answer(client: Any) -> None:
    request = chat(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    _, whole = await post(client, {**request, "temperature": 0})
    resp = await client.post("/v1/chat/completions", json={**request, "temperature": 0,
                                                           "stream": True})  # fmt: skip
    events = [e for e in await read_events(resp) if isinstance(e, dict)]
    deltas = [e["choices"][0]["delta"] for e in events]
    tool_deltas = [d["tool_calls"][0] for d in deltas if d.get("tool_calls")]
    assert tool_deltas[0]["function"]["arguments"] == "" and tool_deltas[0]["type"] == "function"
    assert {d["index"] for d in tool_deltas} == {0}
    arguments = "".join(d["function"]["arguments"] for d in tool_deltas)
    [want] = whole["choices"][0]["message"]["tool_calls"]
    assert tool_deltas[0]["function"]["name"] == want["function"]["name"]
    assert json.loads(arguments) == json.loads(want["function"]["arguments"])
    assert "".join(d.get("content") or "" for d in deltas) == ""
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_a_history_with_calls_and_results(client: Any) -> None:
    args = json.dumps({"city": "Paris", "days": 1})
    history = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]  # fmt: skip
    status, body = await post(
        client, chat(messages=history, tool_choice="none", temperature=0, max_tokens=8)
    )
    assert status == 200, body
    message = body["choices"][0]["message"]
    assert isinstance(message["content"], str) and "tool_calls" not in message
    assert body["choices"][0]["finish_reason"] in ("stop", "length")


async def test_the_fallback_prompt_shows_tools_calls_and_results(checkpoint: Path) -> None:
    tok = Tokenizer.from_dir(checkpoint)
    model = ModelInfo("m", tok, tok.vocab_size, 2048, 2048)
    history = [
        {"role": "system", "content": "Be brief."},
        *MESSAGES,
        {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function",
             "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "noon"},
    ]  # fmt: skip
    ids = chat_prompt_ids({"messages": history, "tools": [WEATHER, TIME]}, model)
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(WEATHER) in text
    assert '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\nnoon\n</tool_response><|im_end|>" in text


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": "get_weather"}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"tools": [BAD_SCHEMA]}, "tools[0].function.parameters"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"id": "x"}]}]},
            "messages[0].tool_calls[0]",
        ),
    ],
)
async def test_malformed_tool_requests_name_the_field(
    client: Any, extra: dict[str, Any], param: str
) -> None:
    status, body = await post(client, chat(**extra))
    assert status == 400, body
    assert body["error"]["param"] == param, body


# A Llama 3.1-like template that renders tools itself (only what the test looks at).
NATIVE = (
    "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: "
    "{% if m.tool_calls %}{{ m.tool_calls[0].function.arguments | tojson }}"
    "{% else %}{{ m.content }}{% endif %}\n{% endfor %}<|python_tag|>"
)


async def test_a_template_that_knows_tools_renders_them(checkpoint: Path) -> None:
    tok = Tokenizer.from_dir(checkpoint)
    tok.chat_template = NATIVE
    model = ModelInfo("m", tok, tok.vocab_size, 2048, 2048)
    history = [
        *MESSAGES,
        {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "rain"},
    ]  # fmt: skip
    ids = chat_prompt_ids({"messages": history, "tools": [TIME]}, model)
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.startswith("TOOLS " + json.dumps([TIME]))
    # Arguments reach the template as an object, as transformers passes them.
    assert 'assistant: {"city": "Rome"}tool: rain' in text  # trim_blocks ate the newlines
    body = {"messages": MESSAGES, "tools": [TIME], "tool_choice": "required"}
    req = parse_request("chat", body, model, None)
    assert req.tools is not None and req.tools.parser.name == "llama3_json"
    assert req.params.structured is not None
    assert '\\"parameters\\": ' in req.params.structured.source
