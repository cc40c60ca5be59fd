"""Structured outputs with real processes: the official client's ``parse`` (whole and streamed)
on a colocated daemon, a prefill + decode pair, and through the router.

The tiny model has random weights: it writes JSON that parses into the Pydantic model only
because of the grammar. In the disaggregated pair the first token is sampled by the prefill
daemon, so a greedy answer equal to the colocated one shows that daemon masked it too.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from cluster import Proc, cluster, free_port, metric, wait_healthy
from e2e_helpers import DAEMON_AUTH, DAEMON_KEY, TOKEN, request, wait_all_up

pytestmark = pytest.mark.slow

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Describe a fruit as JSON."}]


class Fruit(BaseModel):
    model_config = ConfigDict(extra="forbid")
    fruit: Literal["apple", "pear", "plum"]
    ripe: bool
    grams: int = Field(ge=1, le=999)


@dataclass
class World:
    both: Proc
    prefill: Proc
    decode: Proc
    router: Proc


def router_config(path: Path, port: int, members: list[Proc], token: Path) -> Path:
    key = path.parent / "daemon-key"
    key.write_text(DAEMON_KEY + "\n")
    urls = ", ".join(f'"{p.url}"' for p in members)
    path.write_text(
        "[router]\n"
        f'listen = "127.0.0.1:{port}"\n'
        'here = "edge"\n'
        f'admin_token_file = "{token}"\n'
        f'daemon_api_key_file = "{key}"\n'
        "heartbeat_interval_s = 1.0\n"
        "discovery_interval_s = 0.2\n"
        # A loose ITL SLO: a busy test host must not make the only decode daemon unplaceable.
        "itl_slo_s = 5.0\n"
        "\n[[pop]]\n"
        'name = "edge"\nlat = 0.0\nlon = 0.0\n'
        f"daemons = [{urls}]\n"
    )
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("structured_e2e")
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
            env=env,
        )  # fmt: skip
        port = free_port()
        router = c.router(
            "router", router_config(tmp / "router.toml", port, [prefill, decode], token), port
        )
        wait_healthy(both)
        wait_healthy(decode)
        wait_all_up(router, 2)
        yield World(both, prefill, decode, router)


def client_for(proc: Proc, key: str = DAEMON_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=proc.url + "/v1", api_key=key, max_retries=0)


def parse(client: openai.OpenAI, **extra: object) -> Fruit:
    done = client.beta.chat.completions.parse(
        model=MODEL, messages=MESSAGES, response_format=Fruit, max_tokens=80, **extra
    )
    choice = done.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Fruit), choice.message.content
    return choice.message.parsed


def stream_parse(client: openai.OpenAI, **extra: object) -> Fruit:
    with client.beta.chat.completions.stream(
        model=MODEL, messages=MESSAGES, response_format=Fruit, max_tokens=80, **extra
    ) as stream:
        final = stream.get_final_completion()
    parsed = final.choices[0].message.parsed
    assert isinstance(parsed, Fruit), final.choices[0].message.content
    return parsed


def test_parse_on_a_colocated_daemon(world: World) -> None:
    client = client_for(world.both)
    greedy = parse(client, temperature=0)
    assert stream_parse(client, temperature=0) == greedy
    for seed in range(3):  # sampled answers obey the grammar too
        parse(client, temperature=1.0, seed=seed)


def test_the_prefill_daemon_samples_the_first_token_under_the_grammar(world: World) -> None:
    before = metric(world.decode.url, "edgeinfer_kv_transfer_bytes_total", 'direction="received"')
    colocated = parse(client_for(world.both), temperature=0)
    assert parse(client_for(world.decode), temperature=0) == colocated
    assert stream_parse(client_for(world.decode), temperature=0) == colocated
    for seed in range(2):
        parse(client_for(world.decode), temperature=1.0, seed=seed)
    after = metric(world.decode.url, "edgeinfer_kv_transfer_bytes_total", 'direction="received"')
    assert after > before, "the decode daemon was meant to prefill remotely"
    assert metric(world.decode.url, "edgeinfer_kv_transfer_failures_total") == 0


def test_completions_with_a_regex_on_the_pair(world: World) -> None:
    body = {"model": MODEL, "prompt": "Code:", "max_tokens": 20, "temperature": 0,
            "structured_outputs": {"regex": "[A-Z]{3}-[0-9]{4}"}}  # fmt: skip
    want = request(world.both.url + "/v1/completions", "POST", body, DAEMON_AUTH)
    got = request(world.decode.url + "/v1/completions", "POST", body, DAEMON_AUTH)
    assert want.status == got.status == 200, (want, got)
    assert json.loads(got.body)["choices"][0]["text"] == json.loads(want.body)["choices"][0]["text"]


def test_parse_through_the_router(world: World) -> None:
    # The router has no api_keys_file here: any client key passes. The decode daemon
    # advertises a local-prefill threshold of 0, so the router names the PoP's prefill daemon
    # (x-edge-prefill) and presents its daemon key: the decode daemon trusts that header.
    before = metric(world.prefill.url, "edgeinfer_kv_transfer_bytes_total", 'direction="sent"')
    client = client_for(world.router, key="client")
    assert parse(client, temperature=0) == parse(client_for(world.both), temperature=0)
    stream_parse(client, temperature=1.0, seed=4)
    after = metric(world.prefill.url, "edgeinfer_kv_transfer_bytes_total", 'direction="sent"')
    assert after > before, "the prompts were meant to be prefilled on the prefill daemon"
    fmt = {"type": "json_schema", "json_schema": {"name": "fruit", "strict": True,
           "schema": Fruit.model_json_schema()}}  # fmt: skip
    reply = request(
        world.router.url + "/v1/chat/completions", "POST",
        {"model": MODEL, "messages": MESSAGES, "response_format": fmt, "temperature": 0},
    )  # fmt: skip
    assert reply.status == 200 and reply.prefill_pop == "edge", reply
    Fruit.model_validate_json(json.loads(reply.body)["choices"][0]["message"]["content"])
    bad = request(
        world.router.url + "/v1/chat/completions", "POST",
        {"model": MODEL, "messages": MESSAGES, "guided_regex": "a(b"},
    )  # fmt: skip
    assert bad.status == 400
    assert json.loads(bad.body)["error"]["param"] == "guided_regex"
