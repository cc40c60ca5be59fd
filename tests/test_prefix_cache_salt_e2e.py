"""Tenant-isolated prefix caches in real daemon processes: colocated, and prefill + decode with
the KV pages (and the salt) over ZeroMQ. ``cached_tokens`` is 0 across tenants, > 0 within one."""

from __future__ import annotations

import json
import random
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from cluster import cluster, metric, wait_healthy
from edgeinfer.daemon.engine.tiny_checkpoint import build_tiny_checkpoint

# 100 tokens: six whole 16-token blocks; the colocated daemon always computes the last token,
# the prefill daemon's cache serves all six blocks on a repeat.
PROMPT = [random.Random(16).randrange(3, 512) for _ in range(100)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("salt_e2e") / "m", num_layers=2)


def complete(url: str, tenant: str | None, **extra: Any) -> tuple[list[int], int]:
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}  # fmt: skip
    headers = {"Content-Type": "application/json"}
    if tenant is not None:
        headers["x-edge-cache-salt"] = tenant
    req = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers=headers
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        data = json.loads(resp.read())
    return data["choices"][0]["token_ids"], data["usage"]["prompt_tokens_details"]["cached_tokens"]


def cached_sequence(url: str, calls: list[tuple[str | None, dict[str, Any]]]) -> list[int]:
    tokens, counts = set(), []
    for tenant, extra in calls:
        got, n = complete(url, tenant, **extra)
        tokens.add(tuple(got))
        counts.append(n)
    assert len(tokens) == 1, "salting changed the generated tokens"
    return counts


CALLS: list[tuple[str | None, dict[str, Any]]] = [
    ("tenant-a", {}),
    ("tenant-a", {}),
    ("tenant-b", {}),
    ("tenant-b", {}),
    ("tenant-a", {"cache_salt": "s1"}),
    ("tenant-a", {"cache_salt": "s1"}),
    (None, {}),
]


def test_cached_tokens_stay_within_a_tenant(checkpoint: Path, tmp_path: Path) -> None:
    with cluster(tmp_path) as c:
        prefill = c.daemon("prefill", checkpoint, "--role", "prefill")
        both = c.daemon("both", checkpoint, "--role", "both")
        wait_healthy(prefill)
        # A configured peer: trusted whatever the caller presents.
        decode = c.daemon(
            "decode", checkpoint, "--role", "decode",
            "--prefill-peer", prefill.tcp_endpoint("kv"), "--local-prefill-threshold", "0",
        )  # fmt: skip
        wait_healthy(both)
        wait_healthy(decode)

        assert cached_sequence(both.url, CALLS) == [0, 96, 0, 96, 0, 96, 0]
        # Remote prefill: the prefill daemon's cache is salted too, and what it held is what
        # was computed nowhere for the request.
        assert cached_sequence(decode.url, CALLS) == [0, 96, 0, 96, 0, 96, 0]
        assert metric(decode.url, "edgeinfer_kv_transfer_bytes_total", 'direction="received"') > 0
        assert metric(decode.url, "edgeinfer_kv_transfer_failures_total") == 0
