"""Prefix-aware placement end to end: one router, three tiny `both` daemons in one PoP.

Geography and load are equal between the daemons, so where a request lands is the prefix
index's doing: a conversation's second turn goes to the daemon that holds its first (the answer
reports the history as cached tokens), and a system prompt every request shares is spread over
the daemons by the load guard instead of piling onto the first one to cache it.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from cluster import Proc, cluster, free_port, metric, wait_healthy
from e2e_helpers import DAEMON_KEY, TOKEN, Reply, request, wait_all_up
from edgeinfer.daemon.engine.tiny_checkpoint import build_tiny_checkpoint

STORY = "Tell me about the little town by the sea and the baker who lived there. "
BLOCK = 16  # the daemons' default block size


@dataclass
class World:
    router: Proc
    daemons: list[Proc]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("e2e_prefix")
    model = build_tiny_checkpoint(tmp / "model")
    env = {"EDGEINFER_ADMIN_TOKEN": TOKEN, "EDGEINFER_API_KEY": DAEMON_KEY}
    with cluster(tmp) as c:
        daemons = [
            c.daemon(f"both-{i}", model, "--role", "both", "--pop", "lhr", env=env)
            for i in range(3)
        ]
        key, token = tmp / "daemon-key", tmp / "admin-token"
        key.write_text(DAEMON_KEY + "\n")
        token.write_text(TOKEN + "\n")
        port = free_port()
        urls = ", ".join(f'"{d.url}"' for d in daemons)
        config = tmp / "router.toml"
        config.write_text("\n".join([
            "[router]", f'daemon_api_key_file = "{key}"', f'listen = "127.0.0.1:{port}"',
            'here = "lhr"', f'admin_token_file = "{token}"', "heartbeat_interval_s = 1.0",
            "itl_slo_s = 5.0", "discovery_interval_s = 0.2", "catchment_km = 0.0",
            "", "[[pop]]", 'name = "lhr"', "lat = 51.5", "lon = -0.1", f"daemons = [{urls}]",
        ]) + "\n")  # fmt: skip
        router = c.router("router", config, port)
        for d in daemons:
            wait_healthy(d)
        wait_all_up(router, 3)
        _wait_for_tokenizer(router)
        yield World(router, daemons)


def _chat(router: Proc, messages: list[dict[str, str]], max_tokens: int = 8) -> Reply:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    reply = request(router.url + "/v1/chat/completions", "POST", body)
    assert reply.ok, reply
    return reply


def _wait_for_tokenizer(router: Proc, timeout: float = 60.0) -> None:
    """Until the router has fetched the daemons' tokenizer (it asks on the first request)."""
    deadline = time.monotonic() + timeout
    while metric(router.url, "edgeinfer_router_prefix_blocks_asked_total") == 0:
        assert time.monotonic() < deadline, "the router never fetched the tokenizer"
        _chat(router, [{"role": "user", "content": STORY}], max_tokens=1)
        time.sleep(0.2)


def _wait_indexed(router: Proc, before: float, timeout: float = 30.0) -> None:
    """Until the router's prefix index holds more (block, daemon) pairs than ``before``."""
    deadline = time.monotonic() + timeout
    while metric(router.url, "edgeinfer_router_prefix_index_blocks") <= before:
        assert time.monotonic() < deadline, "the daemon's cache events never reached the router"
        time.sleep(0.05)


def _served(world: World) -> list[float]:
    return [metric(d.url, "edgeinfer_request_success_total") for d in world.daemons]


def test_a_second_turn_goes_to_the_daemon_holding_the_first(world: World) -> None:
    for n in range(4):  # a lucky guess would hold for a third of them
        history = [{"role": "system", "content": f"Conversation {n}. " + STORY * 3},
                   {"role": "user", "content": f"Question {n}: " + STORY}]  # fmt: skip
        before = metric(world.router.url, "edgeinfer_router_prefix_index_blocks")
        first = _chat(world.router, history)
        first_prompt = json.loads(first.body)["usage"]["prompt_tokens"]
        answer = json.loads(first.body)["choices"][0]["message"]["content"]
        _wait_indexed(world.router, before)
        second = _chat(world.router, [*history, {"role": "assistant", "content": answer},
                                      {"role": "user", "content": "And then?"}])  # fmt: skip
        cached = json.loads(second.body)["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= (first_prompt // BLOCK - 1) * BLOCK, (n, cached, first_prompt)


def test_a_hot_system_prompt_is_spread_over_the_daemons(world: World) -> None:
    system = {"role": "system", "content": "You are the town's historian. " + STORY * 4}
    before = metric(world.router.url, "edgeinfer_router_prefix_index_blocks")
    _chat(world.router, [system, {"role": "user", "content": "warm up"}])
    _wait_indexed(world.router, before)
    served = _served(world)
    n = 12
    asks = [[system, {"role": "user", "content": f"Question {i}?"}] for i in range(n)]
    threads = [threading.Thread(target=_chat, args=(world.router, ask, 24)) for ask in asks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    counts = [after - b for after, b in zip(_served(world), served, strict=True)]
    assert sum(counts) == n
    # Without the guard every request would go to the one daemon holding the prompt.
    assert max(counts) < n, counts
    assert sum(1 for c in counts if c > 0) >= 2, counts
