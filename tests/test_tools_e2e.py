"""The ``openai`` client's tool loop with real processes: a forced call, the tool's answer sent
back as a ``tool`` message, and a final answer with ``tool_choice: "none"``, on a colocated
daemon, on a prefill + decode pair (the same call as colocated: the prefill daemon sampled the
first token under the call grammar) and through the router, whole and streamed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageFunctionToolCall

from cluster import cluster, free_port, metric, wait_healthy
from e2e_helpers import DAEMON_KEY, TOKEN, wait_all_up
from test_structured_e2e import MODEL, World, client_for, router_config

pytestmark = pytest.mark.slow

WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}
QUESTION: Any = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("tools_e2e")
    env = {"EDGEINFER_API_KEY": DAEMON_KEY}
    token = tmp / "admin-token"
    token.write_text(TOKEN + "\n")
    with cluster(tmp) as c:
        both = c.daemon("both", Path(MODEL), "--role", "both", env=env)
        prefill = c.daemon("prefill", Path(MODEL), "--role", "prefill", "--pop", "edge", env=env)
        wait_healthy(prefill)
        decode = c.daemon(
            "decode", Path(MODEL), "--role", "decode", "--pop", "edge",
            "--prefill-peer", prefill.tcp_endpoint("kv"), "--local-prefill-threshold", "0",
            "--tool-call-parser", "hermes", env=env,
        )  # fmt: skip
        port = free_port()
        router = c.router(
            "router", router_config(tmp / "router.toml", port, [prefill, decode], token), port
        )
        wait_healthy(both)
        wait_healthy(decode)
        wait_all_up(router, 2)
        yield World(both, prefill, decode, router)


def call(client: openai.OpenAI, choice: Any = NAMED) -> tuple[str, dict[str, Any], Any]:
    done = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=[WEATHER], tool_choice=choice,
        temperature=0, max_tokens=200,
    )  # fmt: skip
    answer = done.choices[0]
    assert answer.finish_reason == "tool_calls", answer
    [tool_call] = answer.message.tool_calls or []
    assert isinstance(tool_call, ChatCompletionMessageFunctionToolCall)
    args = json.loads(tool_call.function.arguments)
    assert args["city"] in ("Paris", "Rome") and args["unit"] in ("C", "F")
    return tool_call.function.name, args, answer.message


def stream_call(client: openai.OpenAI, choice: Any = NAMED) -> tuple[str, dict[str, Any]]:
    with client.beta.chat.completions.stream(
        model=MODEL, messages=QUESTION, tools=[WEATHER], tool_choice=choice,
        temperature=0, max_tokens=200,
    ) as stream:  # fmt: skip
        final = stream.get_final_completion()
    answer = final.choices[0]
    assert answer.finish_reason == "tool_calls", answer
    [tool_call] = answer.message.tool_calls or []
    assert isinstance(tool_call, ChatCompletionMessageFunctionToolCall)
    return tool_call.function.name, json.loads(tool_call.function.arguments)


def loop(client: openai.OpenAI) -> tuple[str, dict[str, Any]]:
    """The client's whole tool loop; returns the call the model made."""
    name, args, message = call(client)
    assert name == "get_weather"
    # The reply goes back as the client returned it, as OpenAI's examples do.
    history: list[Any] = [
        *QUESTION,
        message,
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny, 21 C"},
    ]
    final = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
        temperature=0, max_tokens=10,
    )  # fmt: skip
    assert isinstance(final.choices[0].message.content, str)
    assert not final.choices[0].message.tool_calls
    return name, args


def test_the_tool_loop_on_a_colocated_daemon(world: World) -> None:
    client = client_for(world.both)
    made = loop(client)
    assert stream_call(client) == made
    name, _, _ = call(client, choice="required")
    assert name == "get_weather"


def test_the_pair_makes_the_same_call_as_colocated(world: World) -> None:
    before = metric(world.decode.url, "edgeinfer_kv_transfer_bytes_total", 'direction="received"')
    colocated = loop(client_for(world.both))
    assert loop(client_for(world.decode)) == colocated
    assert stream_call(client_for(world.decode)) == colocated
    after = metric(world.decode.url, "edgeinfer_kv_transfer_bytes_total", 'direction="received"')
    assert after > before, "the decode daemon was meant to prefill remotely"


def test_the_tool_loop_through_the_router(world: World) -> None:
    client = client_for(world.router, key="client")
    colocated = loop(client_for(world.both))
    assert loop(client) == colocated
    assert stream_call(client) == colocated
