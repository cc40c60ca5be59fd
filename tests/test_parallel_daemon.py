"""An ``edge-daemon --tensor-parallel 2`` process: serves like one process, and a killed
worker rank ends it non-zero within a bounded time (issue: parallel)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.request
from pathlib import Path

import pytest

from cluster import cluster, http_get, wait_healthy
from edgeinfer.daemon.engine.llm_engine import LLMEngine
from engine_helpers import make_checkpoint
from parallel_helpers import GREEDY, PROMPTS, engine_config

pytestmark = pytest.mark.slow


def worker_ranks(daemon: int) -> list[int]:
    """The daemon's grandchildren: its worker ranks hang off a fork server, its child."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                # The command name in parentheses may hold spaces: split after the last ')'.
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(entry.name)] = int(fields[1])
    children = {p for p, parent in parents.items() if parent == daemon}
    return [p for p, parent in parents.items() if parent in children]


def test_tp2_daemon_serves_and_dies_cleanly_with_a_rank(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path, "LlamaForCausalLM")
    want = LLMEngine(engine_config(ckpt)).generate([PROMPTS[2]], GREEDY)[0].token_ids
    with cluster(tmp_path) as c:
        daemon = c.daemon("tp2", ckpt, "--tensor-parallel", "2")
        wait_healthy(daemon)
        body = {"model": str(ckpt), "prompt": PROMPTS[2], "max_tokens": GREEDY.max_tokens,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        req = urllib.request.Request(
            daemon.url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert json.loads(resp.read())["choices"][0]["token_ids"] == want

        workers = worker_ranks(daemon.popen.pid)
        assert len(workers) == 1, workers
        os.kill(workers[0], signal.SIGKILL)
        try:
            code = daemon.popen.wait(120)  # a hang guard: the daemon notices within seconds
        except subprocess.TimeoutExpired:
            pytest.fail(f"the daemon outlived its rank by 120 s:\n{daemon.output()}")
        assert code != 0
        assert "the engine failed: parallel engine failed: rank 1" in daemon.output()
        with pytest.raises(OSError):  # nobody listens any more
            http_get(daemon.url + "/health", timeout=2)
