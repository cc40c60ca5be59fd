"""Prefill and decode in separate daemon processes, KV pages over ZeroMQ (issue: daemon)."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import zmq

from cluster import cluster, http_get, metric, wait_healthy
from edgeinfer.daemon.engine.tiny_checkpoint import build_tiny_checkpoint


def post(url: str, body: dict, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def stream(url: str, body: dict, timeout: float = 120.0) -> list[dict]:
    req = urllib.request.Request(
        url,
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    events = []
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def model_id(base: str) -> str:
    return json.loads(http_get(base + "/v1/models")[1])["data"][0]["id"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    # Wider than the usual tiny model so a long prefill takes long enough to be interrupted.
    return build_tiny_checkpoint(
        tmp_path_factory.mktemp("disagg") / "m", hidden_size=256, num_layers=4, num_heads=8
    )


PROMPTS = [
    [random.Random(i).randrange(3, 512) for _ in range(n)] for i, n in enumerate((1, 17, 40, 300))
]


def test_prefill_decode_pair_matches_colocated(checkpoint, tmp_path):
    with cluster(tmp_path) as c:
        prefill = c.daemon("prefill", checkpoint, "--role", "prefill")
        wait_healthy(prefill)
        decode = c.daemon(
            "decode", checkpoint, "--role", "decode",
            "--prefill-peer", prefill.tcp_endpoint("kv"), "--local-prefill-threshold", "0",
        )  # fmt: skip
        both = c.daemon("both", checkpoint, "--role", "both")
        wait_healthy(decode)
        wait_healthy(both)
        name = model_id(both.url)
        assert http_get(prefill.url + "/v1/completions")[0] in (404, 405)

        for prompt in PROMPTS:
            body = {"model": name, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}  # fmt: skip
            want = post(both.url + "/v1/completions", body)["choices"][0]
            got = post(decode.url + "/v1/completions", body)["choices"][0]
            assert got["token_ids"] == want["token_ids"]
            assert got["text"] == want["text"]
            chunks = stream(decode.url + "/v1/completions", body)
            assert (
                "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"]) == want["text"]
            )

        chat = {"model": name, "messages": [{"role": "user", "content": "hello there"}],
                "max_tokens": 8, "temperature": 0}  # fmt: skip
        want_chat = post(both.url + "/v1/chat/completions", chat)["choices"][0]["message"]
        got_chat = post(decode.url + "/v1/chat/completions", chat)["choices"][0]["message"]
        assert got_chat == want_chat
        deltas = stream(decode.url + "/v1/chat/completions", chat)
        text = "".join(
            d["choices"][0]["delta"].get("content") or "" for d in deltas if d["choices"]
        )
        assert text == want_chat["content"]

        # It really went over the wire, and every block came back.
        assert metric(decode.url, "edgeinfer_kv_transfer_bytes_total", 'direction="received"') > 0
        assert metric(prefill.url, "edgeinfer_kv_transfer_bytes_total", 'direction="sent"') > 0
        assert metric(decode.url, "edgeinfer_kv_blocks_used") == 0
        state = json.loads(http_get(decode.url + "/v1/state")[1])
        assert state["role"] == "decode" and state["heartbeat_endpoint"].startswith("tcp://")


def test_prefill_killed_mid_transfer_request_still_completes(checkpoint, tmp_path):
    prompt = [random.Random(99).randrange(3, 512) for _ in range(1900)]
    with cluster(tmp_path) as c:
        # Small chunks: the long prompt's KV leaves in many messages over many steps.
        prefill = c.daemon(
            "prefill", checkpoint, "--role", "prefill",
            env={"EDGEINFER_MAX_NUM_BATCHED_TOKENS": "16"},
        )  # fmt: skip
        wait_healthy(prefill)
        decode = c.daemon(
            "decode", checkpoint, "--role", "decode",
            "--prefill-peer", prefill.tcp_endpoint("kv"), "--local-prefill-threshold", "0",
        )  # fmt: skip
        both = c.daemon("both", checkpoint, "--role", "both")
        wait_healthy(decode)
        wait_healthy(both)
        name = model_id(both.url)
        body = {"model": name, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        want = post(both.url + "/v1/completions", body)["choices"][0]["token_ids"]

        result: dict = {}
        worker = threading.Thread(
            target=lambda: result.update(post(decode.url + "/v1/completions", body))
        )
        worker.start()
        deadline = time.monotonic() + 60
        while metric(decode.url, "edgeinfer_kv_transfer_bytes_total", 'direction="received"') == 0:
            assert time.monotonic() < deadline, "no KV ever arrived"
            time.sleep(0.005)
        prefill.kill()  # SIGKILL while pages are still streaming
        worker.join(120)
        assert result["choices"][0]["token_ids"] == want
        assert metric(decode.url, "edgeinfer_kv_transfer_failures_total") >= 1
        assert metric(decode.url, "edgeinfer_kv_blocks_used") == 0
        assert metric(decode.url, "edgeinfer_num_requests_running") == 0


def test_garbage_on_kv_port_is_dropped_and_serving_continues(checkpoint, tmp_path):
    with cluster(tmp_path) as c:
        prefill = c.daemon("prefill", checkpoint, "--role", "prefill")
        wait_healthy(prefill)
        decode = c.daemon(
            "decode", checkpoint, "--role", "decode",
            "--prefill-peer", prefill.tcp_endpoint("kv"), "--local-prefill-threshold", "0",
        )  # fmt: skip
        wait_healthy(decode)
        name = model_id(decode.url)
        body = {"model": name, "prompt": PROMPTS[3], "max_tokens": 6, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        before = post(decode.url + "/v1/completions", body)["choices"][0]["token_ids"]

        # Raw bytes that are not ZMTP at all.
        with socket.create_connection(("127.0.0.1", prefill.ports["kv"])) as raw:
            raw.sendall(random.Random(1).randbytes(4096))
        # Well-framed ZeroMQ messages with garbage, truncated and replayed content.
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(prefill.tcp_endpoint("kv"))
        rng = random.Random(2)
        for _ in range(20):
            dealer.send_multipart(
                [rng.randbytes(rng.randrange(0, 300)) for _ in range(rng.randrange(1, 4))]
            )
        dealer.send_multipart([b"\x00\x00\x00\x00\x81\xa1v\x01"])  # a truncated header
        deadline = time.monotonic() + 60  # a hang guard: the drops are counted long before
        while metric(prefill.url, "edgeinfer_kv_transfer_dropped_frames_total") < 20:
            assert time.monotonic() < deadline, "the garbage was never dropped"
            time.sleep(0.01)
        dealer.close()
        ctx.term()

        assert http_get(prefill.url + "/health")[0] == 200
        after = post(decode.url + "/v1/completions", body)["choices"][0]["token_ids"]
        assert after == before
        assert prefill.popen.poll() is None
