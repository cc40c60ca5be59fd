"""n, echo, prompt logprobs, logit_bias and /tokenize through a real router, with prefill and
decode on different daemons, answer as a colocated daemon does (issue 18, evaluation).

One router (with a keys file, as a public endpoint) in front of a prefill daemon and a decode
daemon; a ``both`` daemon beside them is the colocated reference, called directly with the
daemon key as the router would. The first choice of an ``n`` > 1 request is prefilled remotely
(KV over ZeroMQ, the first token sampled on the prefill daemon with its seed) and the other
choices reuse its blocks from the decode daemon's prefix cache; a request asking for prompt
logprobs is prefilled on the decode daemon itself, where the logits are.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cluster import Proc, cluster, free_port, metric, wait_healthy
from e2e_helpers import DAEMON_AUTH, DAEMON_KEY, EDGECTL, TOKEN, Reply, request, wait_all_up
from edgeinfer.daemon.engine.tiny_checkpoint import build_tiny_checkpoint

# The decode daemon advertises it: prompts over this many tokens are prefilled remotely.
LOCAL_PREFILL_MAX = 8
PROMPT = "Tell me about the little town by the sea and the baker who lived there. " * 3


@dataclass
class World:
    router: Proc
    prefill: Proc
    decode: Proc
    both: Proc
    key: str

    def via_router(self, path: str, body: dict[str, Any], key: str | None = "") -> Reply:
        key = self.key if key == "" else key
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        return request(self.router.url + path, "POST", body, headers)

    def colocated(self, path: str, body: dict[str, Any]) -> Reply:
        return request(self.both.url + path, "POST", body, DAEMON_AUTH)


def router_config(path: Path, port: int, daemons: list[Proc], token: Path, keys: Path) -> Path:
    daemon_key = path.parent / "daemon-key"
    daemon_key.write_text(DAEMON_KEY + "\n")
    urls = ", ".join(f'"{d.url}"' for d in daemons)
    path.write_text(
        "[router]\n"
        f'listen = "127.0.0.1:{port}"\n'
        'here = "edge"\n'
        f'admin_token_file = "{token}"\n'
        f'api_keys_file = "{keys}"\n'
        f'daemon_api_key_file = "{daemon_key}"\n'
        "heartbeat_interval_s = 1.0\n"
        "discovery_interval_s = 0.2\n"
        "\n[[pop]]\n"
        'name = "edge"\nlat = 0.0\nlon = 0.0\n'
        f"daemons = [{urls}]\n"
    )
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("api_eval_e2e")
    model = build_tiny_checkpoint(tmp / "model", num_layers=2)
    keys = tmp / "keys.toml"
    created = subprocess.run(
        [*EDGECTL, "keys", "create", "--tenant", "eval", "--file", str(keys)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    token = tmp / "admin-token"
    token.write_text(TOKEN + "\n")
    env = {"EDGEINFER_API_KEY": DAEMON_KEY}
    with cluster(tmp) as c:
        prefill = c.daemon("prefill", model, "--role", "prefill", "--pop", "edge", env=env)
        decode = c.daemon(
            "decode", model, "--role", "decode", "--pop", "edge",
            "--local-prefill-threshold", str(LOCAL_PREFILL_MAX), env=env,
        )  # fmt: skip
        both = c.daemon("both", model, "--role", "both", env=env)
        port = free_port()
        config = router_config(tmp / "router.toml", port, [prefill, decode], token, keys)
        router = c.router("router", config, port)
        for proc in (prefill, decode, both):
            wait_healthy(proc)
        wait_all_up(router, 2)
        yield World(router, prefill, decode, both, created.stdout.strip())


def answer(reply: Reply) -> dict[str, Any]:
    assert reply.status == 200, reply
    return dict(json.loads(reply.body))


def assert_same_choices(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Same tokens and text; log-probs equal up to float32 rounding of other batch shapes."""
    assert len(got["choices"]) == len(want["choices"])
    for a, b in zip(got["choices"], want["choices"], strict=True):
        assert (a["index"], a["text"], a.get("token_ids")) == (
            b["index"],
            b["text"],
            b.get("token_ids"),
        )
        if b["logprobs"] is not None:
            assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
            for x, y in zip(a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"]):
                assert (x is None and y is None) or abs(x - y) < 1e-4
        for x, y in zip(a.get("prompt_logprobs") or [], b.get("prompt_logprobs") or []):
            assert (x is None and y is None) or x.keys() == y.keys()
    assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
    assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]


BODIES = {
    "n-seeded": {"n": 3, "seed": 11, "temperature": 1.0, "max_tokens": 6},
    "n-greedy-logit-bias": {"n": 2, "temperature": 0, "max_tokens": 4, "logit_bias": {"7": 5}},
    "loglikelihood": {"max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0},
    "prompt-logprobs": {"max_tokens": 3, "prompt_logprobs": 2, "temperature": 0, "n": 2},
}


@pytest.mark.parametrize("name", list(BODIES))
def test_disaggregated_through_the_router_equals_colocated(world: World, name: str) -> None:
    # A prompt of its own: one the decode daemon's prefix cache held would prefill there.
    prompt = f"{name}: {PROMPT}"
    body = {"prompt": prompt, "return_token_ids": True, "ignore_eos": True, **BODIES[name]}
    received = metric(world.decode.url, "edgeinfer_kv_transfer_bytes_total", 'direction="received"')
    via = world.via_router("/v1/completions", body)
    assert_same_choices(answer(via), answer(world.colocated("/v1/completions", body)))
    assert via.decode_pop == "edge"
    after = metric(world.decode.url, "edgeinfer_kv_transfer_bytes_total", 'direction="received"')
    # Scoring the prompt needs its logits, so those requests prefill on the decode daemon.
    scored = "prompt_logprobs" in body or body.get("echo")
    assert (after == received) if scored else (after > received)


def test_streamed_n_choices_through_the_router(world: World) -> None:
    body = {"prompt": PROMPT, "n": 2, "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    reply = world.via_router("/v1/completions", body)
    assert reply.ok, reply
    indices = {e["choices"][0]["index"] for e in reply.events if e["choices"]}
    assert indices == {0, 1} and all("usage" in e for e in reply.events)
    assert reply.events[-1]["usage"]["completion_tokens"] == 8


def test_tokenize_through_the_router_needs_a_key(world: World) -> None:
    body = {"prompt": PROMPT, "return_token_strs": True}
    via = world.via_router("/tokenize", body)
    assert answer(via) == answer(world.colocated("/tokenize", body))
    ids = json.loads(via.body)["tokens"]
    back = answer(world.via_router("/detokenize", {"tokens": ids}))
    assert PROMPT in back["prompt"]
    for path in ("/tokenize", "/detokenize"):
        refused = world.via_router(path, {"prompt": "x", "tokens": [1]}, key=None)
        assert refused.status == 401, refused
        assert json.loads(refused.body)["error"]["code"] == "invalid_api_key"
