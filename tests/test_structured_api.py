"""Structured outputs over HTTP: every field clients use for them, and every way to get it wrong.

The tiny model's weights are random, so valid output can only come from the grammar.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from daemon_helpers import (
    read_events,
)

pytestmark = pytest.mark.asyncio

MESSAGES = [{"role": "user", "content": "Describe a fruit."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "fruit": {"enum": ["apple", "pear", "plum"]},
        "ripe": {"type": "boolean"},
        "grams": {"type": "integer", "minimum": 1, "maximum": 999},
    },
    "required": ["fruit", "ripe", "grams"],
    "additionalProperties": False,
}


def check_fruit(text: str) -> None:
    data = json.loads(text)
    assert data["fruit"] in ("apple", "pear", "plum")
    assert isinstance(data["ripe"], bool)
    assert 1 <= data["grams"] <= 999


async def post(client: Any, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    resp = await client.post(path, json=body)
    return resp.status, await resp.json()


def chat(**extra: Any) -> dict[str, Any]:
    return {"messages": MESSAGES, "max_tokens": 120, "temperature": 1.0, "seed": 3, **extra}


def completion(**extra: Any) -> dict[str, Any]:
    return {"prompt": "Answer:", "max_tokens": 60, "temperature": 1.0, "seed": 5, **extra}


async def test_response_format_json_schema(client: Any) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "f", "schema": SCHEMA, "strict": True}}
    status, body = await post(client, "/v1/chat/completions", chat(response_format=fmt))
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    check_fruit(choice["message"]["content"])


async def test_response_format_json_object_and_text(client: Any) -> None:
    status, body = await post(
        client, "/v1/chat/completions", chat(response_format={"type": "json_object"})
    )
    assert status == 200, body
    assert body["choices"][0]["message"]["content"].startswith("{")
    status, body = await post(
        client, "/v1/chat/completions", chat(response_format={"type": "text"}, max_tokens=4)
    )
    assert status == 200, body


@pytest.mark.parametrize(
    ("fields", "pattern"),
    [
        ({"structured_outputs": {"regex": r"[0-9]{4}"}}, r"[0-9]{4}"),
        ({"structured_outputs": {"choice": ["cat", "dog"]}}, r"cat|dog"),
        ({"structured_outputs": {"grammar": 'root ::= "on" | "off"'}}, r"on|off"),
        ({"structured_outputs": {"regex": "x{3}", "disable_fallback": True}}, r"xxx"),
        ({"guided_regex": r"[a-c]{5}", "guided_decoding_backend": "xgrammar"}, r"[a-c]{5}"),
        ({"guided_choice": ["up", "down"]}, r"up|down"),
        ({"guided_grammar": 'start: "ab"+'}, r"(ab)+"),
    ],
)
async def test_completion_constraints(client: Any, fields: dict[str, Any], pattern: str) -> None:
    status, body = await post(client, "/v1/completions", completion(**fields))
    assert status == 200, body
    assert re.fullmatch(pattern, body["choices"][0]["text"])


async def test_guided_json_on_completions_streams(client: Any) -> None:
    resp = await client.post("/v1/completions", json=completion(guided_json=SCHEMA, stream=True))
    assert resp.status == 200
    events = await read_events(resp)
    text = "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e["choices"])
    check_fruit(text)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "response_format, guided_regex",
        ),
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs.regex, structured_outputs.choice",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": "{"}}},
            "response_format.json_schema.schema",
        ),
        (
            {"structured_outputs": {"whitespace_pattern": " "}},
            "structured_outputs.whitespace_pattern",
        ),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar"),
        ({"structured_outputs": "json"}, "structured_outputs"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": "a"}, "guided_choice"),
        ({"guided_json": {"$ref": "#/nope"}}, "guided_json"),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ],
)
async def test_bad_constraints_are_400s_naming_the_field(
    client: Any, fields: dict[str, Any], param: str
) -> None:
    status, body = await post(client, "/v1/chat/completions", chat(**fields))
    assert status == 400, body
    assert body["error"]["param"] == param, body
    assert body["error"]["type"] == "invalid_request_error"
