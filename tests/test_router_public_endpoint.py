"""The public endpoint end to end: API keys, models and rate limits on a real router process.

One tiny-model daemon behind one router whose keys file ``edgectl keys create`` wrote (the
real CLI, as an operator would), one tenant per test so the tests do not share windows. The
last test revokes a key and sends the router SIGHUP while a stream of that key is in flight:
the daemon is stopped (SIGSTOP) before the stream starts, so the stream is certainly still
running when the key goes, and continued (SIGCONT) once the key is refused.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cluster import Proc, cluster, free_port, wait_healthy
from e2e_helpers import EDGECTL, TOKEN, Reply, admin, request, wait_all_up

MODEL = "tiny"
TENANTS = {  # tenant: edgectl keys create flags
    "open": [],
    "tinyonly": ["--model", MODEL],
    "limited": ["--rpm", "2"],
    "leaving": [],
}


@dataclass
class World:
    router: Proc
    daemon: Proc
    keys_file: Path
    keys: dict[str, str]  # tenant: its key

    def chat(self, key: str | None, *, model: str = MODEL, **body: Any) -> Reply:
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        payload = {"model": model, "messages": [{"role": "user", "content": "Hi"}],
                   "max_tokens": 2, "temperature": 0, **body}  # fmt: skip
        return request(self.router.url + "/v1/chat/completions", "POST", payload, headers)


def edgectl_keys(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*EDGECTL, "keys", *args], capture_output=True, text=True, check=True)


def router_config(path: Path, port: int, daemon: Proc, token: Path, keys_file: Path) -> Path:
    path.write_text(
        "[router]\n"
        f'listen = "127.0.0.1:{port}"\n'
        'here = "edge"\n'
        f'admin_token_file = "{token}"\n'
        f'api_keys_file = "{keys_file}"\n'
        # The daemon beats every 0.3 s; judged against 30 s, a daemon held by SIGSTOP for the
        # revocation test stays placeable and its stream is not given up on.
        "heartbeat_interval_s = 30.0\n"
        "discovery_interval_s = 0.2\n"
        "\n[[pop]]\n"
        'name = "edge"\nlat = 0.0\nlon = 0.0\n'
        f'daemons = ["{daemon.url}"]\n'
    )
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("public_endpoint")
    keys_file = tmp / "keys.toml"
    keys = {}
    for tenant, flags in TENANTS.items():
        created = edgectl_keys("create", "--tenant", tenant, "--file", str(keys_file), *flags)
        keys[tenant] = created.stdout.strip()
    token = tmp / "admin-token"
    token.write_text(TOKEN + "\n")
    with cluster(tmp) as c:
        daemon = c.daemon("daemon", Path(MODEL), "--pop", "edge")
        port = free_port()
        config = router_config(tmp / "router.toml", port, daemon, token, keys_file)
        router = c.router("router", config, port)
        wait_healthy(daemon)
        wait_all_up(router, 1)
        yield World(router, daemon, keys_file, keys)


def error_of(reply: Reply) -> dict[str, Any]:
    assert reply.headers["content-type"].startswith("application/json"), reply
    body = json.loads(reply.body)
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return dict(body["error"])


def test_no_key_is_401(world: World) -> None:
    reply = world.chat(None)
    assert reply.status == 401, reply
    assert error_of(reply)["code"] == "invalid_api_key"
    models = request(world.router.url + "/v1/models")
    assert models.status == 401  # every /v1/* route needs a key


def test_a_wrong_key_is_401_and_not_echoed(world: World) -> None:
    reply = world.chat("ei-not-a-real-key-0123456789")
    assert reply.status == 401, reply
    error = error_of(reply)
    assert error["code"] == "invalid_api_key"
    assert "ei-not-a-real-key" not in reply.body.decode()


def test_a_good_key_is_served_and_the_model_list_needs_it(world: World) -> None:
    reply = world.chat(world.keys["open"])
    assert reply.ok, reply
    assert not [h for h in reply.headers if h.startswith("x-ratelimit")]  # the key has no limits
    models = request(world.router.url + "/v1/models", headers={
        "Authorization": f"Bearer {world.keys['open']}"})  # fmt: skip
    assert models.status == 200
    assert [m["id"] for m in json.loads(models.body)["data"]] == [MODEL]


def test_a_model_the_key_may_not_use_is_403(world: World) -> None:
    reply = world.chat(world.keys["tinyonly"], model="big")
    assert reply.status == 403, reply
    error = error_of(reply)
    assert (error["code"], error["param"]) == ("model_not_allowed", "model")
    assert world.chat(world.keys["tinyonly"]).ok


def test_the_third_request_of_a_two_rpm_key_is_429(world: World) -> None:
    key = world.keys["limited"]
    first = world.chat(key)
    assert first.ok, first
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert first.headers["x-ratelimit-reset-requests"].endswith("s")
    assert world.chat(key).ok
    third = world.chat(key)
    assert third.status == 429, third
    error = error_of(third)
    assert (error["code"], error["type"]) == ("rate_limit_exceeded", "requests")
    assert int(third.headers["retry-after"]) >= 1
    assert third.headers["x-ratelimit-limit-requests"] == "2"
    assert third.headers["x-ratelimit-remaining-requests"] == "0"
    assert world.chat(world.keys["open"]).ok  # another tenant is not limited by it


def in_flight(world: World) -> int:
    reply = admin(world.router, "/admin/pops/edge")
    assert reply.status == 200, reply
    return int(json.loads(reply.body)["in_flight"])


def wait_until(condition: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def test_a_revoked_key_is_refused_after_sighup_while_its_stream_finishes(world: World) -> None:
    key = world.keys["leaving"]
    auth = {"Authorization": f"Bearer {key}"}
    replies: list[Reply] = []
    world.daemon.send_signal(signal.SIGSTOP)
    try:
        stream = threading.Thread(target=lambda: replies.append(
            world.chat(key, stream=True, max_tokens=8, ignore_eos=True)))  # fmt: skip
        stream.start()
        wait_until(lambda: in_flight(world) == 1, "the stream was never placed")
        edgectl_keys("revoke", "--file", str(world.keys_file), "--tenant", "leaving")
        world.router.send_signal(signal.SIGHUP)
        # The reload happens in the router's loop: wait for it on a route that needs no daemon.
        wait_until(
            lambda: request(world.router.url + "/v1/models", headers=auth).status == 401,
            "the revoked key was still accepted after SIGHUP",
        )
        refused = world.chat(key)
        assert refused.status == 401
        assert error_of(refused)["code"] == "invalid_api_key"
        assert in_flight(world) == 1  # the stream admitted before the SIGHUP still runs
    finally:
        world.daemon.send_signal(signal.SIGCONT)
    stream.join(60)
    (reply,) = replies
    assert reply.status == 200 and reply.done and reply.ok, reply
    assert world.chat(world.keys["open"]).ok  # the others' keys still work
