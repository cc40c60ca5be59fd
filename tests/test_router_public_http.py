"""The router as a public HTTP server, with real processes: a tiny daemon behind a real router.

What the fake-daemon tests (tests/test_router_http.py, tests/test_router_proxy.py) cannot show:
the router's errors as a real client sees them, a prompt bigger than the model's context going
through the router to the daemon's own ``context_length_exceeded``, and a non-streaming
generation that is silent for far longer than ``read_timeout_s`` answered exactly once.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from cluster import Proc, cluster, free_port, metric, wait_healthy
from e2e_helpers import TOKEN, request, wait_all_up
from edgeinfer.daemon.engine.tiny_checkpoint import build_tiny_checkpoint

DAEMON_KEY = "router-to-daemon-key-for-tests"
# The window that used to cut a non-streaming answer (then first_byte_timeout_s and the read
# timeout): now it only bounds the silence inside an SSE stream, which this module never uses.
READ_WINDOW_S = 0.005


@dataclass
class World:
    router: Proc
    daemon: Proc


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("router_public_http")
    model = build_tiny_checkpoint(tmp / "model")
    (tmp / "admin-token").write_text(TOKEN + "\n")
    (tmp / "daemon-key").write_text(DAEMON_KEY + "\n")
    with cluster(tmp) as c:
        env = {"EDGEINFER_ADMIN_TOKEN": TOKEN, "EDGEINFER_API_KEY": DAEMON_KEY}
        daemon = c.daemon("daemon", model, "--role", "both", "--pop", "here", env=env)
        port = free_port()
        config = tmp / "router.toml"
        config.write_text(
            "[router]\n"
            f'listen = "127.0.0.1:{port}"\n'
            'here = "here"\n'
            f'admin_token_file = "{tmp / "admin-token"}"\n'
            f'daemon_api_key_file = "{tmp / "daemon-key"}"\n'
            "heartbeat_interval_s = 1.0\n"
            "discovery_interval_s = 0.2\n"
            f"read_timeout_s = {READ_WINDOW_S}\n"
            "\n[[pop]]\n"
            'name = "here"\nlat = 50.0\nlon = 8.0\n'
            f'daemons = ["{daemon.url}"]\n'
        )
        router = c.router("router", config, port)
        wait_healthy(daemon)
        wait_all_up(router, 1)
        yield World(router, daemon)


def openai_error(reply_body: bytes) -> dict[str, Any]:
    body = json.loads(reply_body)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error: dict[str, Any] = body["error"]
    return error


def test_unknown_path_and_wrong_method_are_json_errors(world: World) -> None:
    missing = request(world.router.url + "/v1/embeddings/nope", "GET")
    assert missing.status == 404
    assert missing.headers["content-type"].startswith("application/json")
    assert openai_error(missing.body)["code"] == "not_found"
    wrong = request(world.router.url + "/v1/chat/completions", "GET")
    assert wrong.status == 405 and wrong.headers["allow"] == "POST"
    assert wrong.headers["content-type"].startswith("application/json")
    assert openai_error(wrong.body)["code"] == "method_not_allowed"
    assert re.fullmatch(r"[0-9a-f]{32}", wrong.headers["x-request-id"])


def test_a_2_mib_prompt_reaches_the_daemons_context_length_error(world: World) -> None:
    prompt = "the quick brown fox " * (2 * 1024 * 1024 // 20)
    body = {"prompt": prompt, "max_tokens": 4}
    reply = request(world.router.url + "/v1/completions", "POST", body, timeout=120)
    assert reply.status == 400, reply
    error = openai_error(reply.body)
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert reply.headers["x-edge-decode-pop"] == "here"  # the daemon's answer, not the router's


def test_a_silent_non_streaming_generation_is_answered_once(world: World) -> None:
    done = metric(world.daemon.url, "edgeinfer_request_success_total")
    body = {"prompt": "Once upon a time", "max_tokens": 48,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    headers = {"X-Request-Id": "silent-generation-1"}
    reply = request(world.router.url + "/v1/completions", "POST", body, headers)
    assert reply.status == 200, reply
    assert reply.headers["x-request-id"] == "silent-generation-1"
    assert json.loads(reply.body)["usage"]["completion_tokens"] == 48
    # The daemon was silent (no header, no byte) for the whole generation: far past the window.
    assert reply.finished_at - reply.sent_at > READ_WINDOW_S
    assert metric(world.daemon.url, "edgeinfer_request_success_total") == done + 1
    # Every router line about the request carries its id, the access log line included.
    lines = [ln for ln in world.router.output(20000).splitlines() if "silent-generation-1" in ln]
    assert any('"POST /v1/completions' in ln and " 200 " in ln for ln in lines), lines
