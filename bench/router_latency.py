"""The latency a real ``edge-router`` process adds to a streamed chat, on loopback.

A fake daemon (``fake_daemon.py``: real heartbeats, an instant stream of ``chunks`` SSE events)
and an ``edge-router`` placing on it run as separate processes. One client sends requests one
at a time, alternating direct-to-daemon and through-the-router so that both paths see the same
host noise, each over its own kept-alive connection (as a client SDK does). Per request:

* ``ttft``: request sent -> first SSE event received;
* ``full``: request sent -> end of the streamed body.

The added latency is the router's quantile minus the direct one (p50 and p99). On a shared
host those quantiles carry other processes' scheduling noise, so the router's CPU time per
request (user + system, from ``/proc``) is reported too: the part of its cost no neighbour
can inflate. The load average at the start says how quiet the host was.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import uvloop

from edgeinfer.shared.processes import ChildProcess, free_port, spawn

HERE = Path(__file__).resolve().parent
TARGET_ADDED_P99_MS = 2.0
BODY = (
    b'{"model": "bench-model", "messages": [{"role": "user", "content": "Hello there"}], '
    b'"max_tokens": 64, "stream": true}'
)


@contextlib.contextmanager
def _processes(workdir: Path, chunks: int) -> Iterator[tuple[str, str, int]]:
    """(daemon URL, router URL, router pid) while a fake daemon and a real router run."""
    d_port, hb_port, r_port = free_port(), free_port(), free_port()
    config = workdir / "router.toml"
    config.write_text(
        f'[router]\nlisten = "127.0.0.1:{r_port}"\nhere = "bench"\n'
        "heartbeat_interval_s = 0.5\ndiscovery_interval_s = 0.1\n\n"
        f'[[pop]]\nname = "bench"\nlat = 50.11\nlon = 8.68\ndaemons = ["http://127.0.0.1:{d_port}"]\n'
    )
    daemon_cmd = [sys.executable, str(HERE / "fake_daemon.py"), "--port", str(d_port),
                  "--heartbeat-port", str(hb_port), "--chunks", str(chunks)]  # fmt: skip
    router_cmd = [sys.executable, "-m", "edgeinfer.router.main", "--config", str(config)]
    procs: list[ChildProcess] = []
    try:
        daemon = spawn("daemon", daemon_cmd, workdir=workdir, url=f"http://127.0.0.1:{d_port}")
        procs.append(daemon)
        router = spawn("router", router_cmd, workdir=workdir, url=f"http://127.0.0.1:{r_port}")
        procs.append(router)
        daemon.wait_http("/health", 30)
        router.wait_http("/health", 30)  # 200 once the daemon is discovered and heartbeating
        yield daemon.url, router.url, router.pid
    finally:
        for proc in reversed(procs):
            proc.stop(timeout_s=30)


async def _one(session: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    start = time.perf_counter()
    async with session.post(url, data=BODY, headers={"Content-Type": "application/json"}) as r:
        if r.status != 200:
            raise RuntimeError(f"{url} answered {r.status}: {await r.text()}")
        await r.content.readuntil(b"\n\n")
        ttft = time.perf_counter() - start
        rest = await r.content.read()
        full = time.perf_counter() - start
    if not rest.endswith(b"data: [DONE]\n\n"):
        raise RuntimeError(f"{url}: the stream did not end with [DONE]")
    return ttft, full


async def _measure(daemon: str, router: str, warmup: int, n: int) -> dict[str, np.ndarray]:
    paths = {"direct": daemon, "router": router}
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in paths}
    # One session (one kept-alive connection) per path, so neither pays a handshake.
    sessions = {k: aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) for k in paths}
    try:
        for i in range(warmup + n):
            # Alternate which path goes first so neither always follows the other.
            for key in paths if i % 2 else reversed(paths):
                result = await _one(sessions[key], paths[key] + "/v1/chat/completions")
                if i >= warmup:
                    samples[key].append(result)
    finally:
        for session in sessions.values():
            await session.close()
    return {k: np.asarray(v) * 1000 for k, v in samples.items()}


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_latency(args: Any) -> dict[str, Any]:
    chunks, warmup = 64, 200
    n = 300 if args.quick else 3000
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp, _processes(Path(tmp), chunks) as procs:
        daemon, router, pid = procs
        uvloop.run(_measure(daemon, router, warmup, 0))
        cpu = _cpu_s(pid)
        ms = uvloop.run(_measure(daemon, router, 0, n))
        cpu = _cpu_s(pid) - cpu
    out: dict[str, Any] = {
        "requests_per_path": n,
        "chunks_per_response": chunks,
        "host_load_avg_1m": round(load, 2),
        "router_cpu_ms_per_request": round(cpu / n * 1000, 3),
    }
    for i, metric in enumerate(("ttft", "full")):
        for q in (50, 99):
            direct = float(np.percentile(ms["direct"][:, i], q))
            via = float(np.percentile(ms["router"][:, i], q))
            out[f"{metric}_p{q}_direct_ms"] = round(direct, 3)
            out[f"{metric}_p{q}_router_ms"] = round(via, 3)
            out[f"{metric}_p{q}_added_ms"] = round(via - direct, 3)
    worst = max(out["ttft_p99_added_ms"], out["full_p99_added_ms"])
    out["target_added_p99_ms"] = TARGET_ADDED_P99_MS
    out["meets_target"] = worst < TARGET_ADDED_P99_MS
    return out
