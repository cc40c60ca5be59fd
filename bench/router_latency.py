"""The latency a real ``edge-router`` process adds to a streamed chat, on loopback.

A fake daemon (``fake_daemon.py``: real heartbeats, an instant stream of ``chunks`` SSE events)
and two ``edge-router`` processes placing on it run as separate processes: ``router`` without
API keys, ``router_keys`` with an ``api_keys_file`` whose key has every limit (requests and
tokens per minute, concurrency) set, high enough never to refuse. One client sends requests one
at a time, rotating over direct-to-daemon and the two routers so that every path sees the same
host noise, each over its own kept-alive connection (as a client SDK does). Per request:

* ``ttft``: request sent -> first SSE event received;
* ``full``: request sent -> end of the streamed body.

The added latency is a router's quantile minus the direct one (p50 and p99); keys on and off
are reported side by side, with their ratio. A fourth path, ``floor`` (``floor_proxy.py``: an
aiohttp proxy that only streams the answer through), is measured in the same rotation: what
any aiohttp proxy adds on this host, so the router's added latency over it is the router's
own. On a shared host those quantiles carry other processes' scheduling noise, so each router's CPU time per request (user + system, from
``/proc``) is reported too: the part of its cost no neighbour can inflate. The load average at
the start says how quiet the host was.
"""

from __future__ import annotations

import contextlib
import itertools
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

from edgeinfer.router.tenants import key_digest
from edgeinfer.shared.processes import ChildProcess, free_port, spawn

HERE = Path(__file__).resolve().parent
TARGET_ADDED_P99_MS = 2.0
API_KEY = "ei-bench-key-0123456789abcdef0123456789abcdef"
# Limits the benchmark never reaches: every check runs, none refuses.
KEY_LIMITS = (
    "requests_per_minute = 100000000\ntokens_per_minute = 100000000000\nmax_concurrent = 1000\n"
)
PATHS = ("direct", "router", "router_keys", "floor")
# Each request its own question (the request's number in this process), as users' are: no
# router cache answers for it.
_NUMBERS = itertools.count()
BODY = (
    '{{"model": "bench-model", "messages": [{{"role": "user", "content": "Hello there, {}"}}], '
    '"max_tokens": 64, "stream": true}}'
)


def _router_config(path: Path, port: int, daemon_port: int, keys: Path | None) -> Path:
    keys_line = f'api_keys_file = "{keys}"\n' if keys is not None else ""
    path.write_text(
        f'[router]\nlisten = "127.0.0.1:{port}"\nhere = "bench"\n{keys_line}'
        "heartbeat_interval_s = 0.5\ndiscovery_interval_s = 0.1\n\n"
        f'[[pop]]\nname = "bench"\nlat = 50.11\nlon = 8.68\n'
        f'daemons = ["http://127.0.0.1:{daemon_port}"]\n'
    )
    return path


@contextlib.contextmanager
def _processes(workdir: Path, chunks: int) -> Iterator[dict[str, ChildProcess]]:
    """A fake daemon, two real routers (keys off, keys on) and the floor proxy, by path name,
    while they run."""
    d_port, hb_port = free_port(), free_port()
    keys = workdir / "keys.toml"
    keys.write_text(f'[[key]]\ntenant = "bench"\nsha256 = "{key_digest(API_KEY)}"\n{KEY_LIMITS}')
    daemon_cmd = [sys.executable, str(HERE / "fake_daemon.py"), "--port", str(d_port),
                  "--heartbeat-port", str(hb_port), "--chunks", str(chunks)]  # fmt: skip
    procs: dict[str, ChildProcess] = {}
    try:
        procs["direct"] = spawn(
            "daemon", daemon_cmd, workdir=workdir, url=f"http://127.0.0.1:{d_port}"
        )
        port = free_port()
        floor_cmd = [sys.executable, str(HERE / "floor_proxy.py"), "--port", str(port),
                     "--upstream", procs["direct"].url]  # fmt: skip
        procs["floor"] = spawn("floor", floor_cmd, workdir=workdir, url=f"http://127.0.0.1:{port}")
        for name, keys_file in (("router", None), ("router_keys", keys)):
            port = free_port()
            config = _router_config(workdir / f"{name}.toml", port, d_port, keys_file)
            cmd = [sys.executable, "-m", "edgeinfer.router.main", "--config", str(config)]
            procs[name] = spawn(name, cmd, workdir=workdir, url=f"http://127.0.0.1:{port}")
        for proc in procs.values():
            proc.wait_http("/health", 120)  # a router: once its passes are compiled (cold: ~20 s)
            # and the daemon is discovered and beating
        yield procs
    finally:
        for proc in reversed(procs.values()):
            proc.stop(timeout_s=30)


async def _one(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str]
) -> tuple[float, float]:
    body = BODY.format(next(_NUMBERS)).encode()
    start = time.perf_counter()
    async with session.post(url, data=body, headers=headers) as r:
        if r.status != 200:
            raise RuntimeError(f"{url} answered {r.status}: {await r.text()}")
        await r.content.readuntil(b"\n\n")
        ttft = time.perf_counter() - start
        rest = await r.content.read()
        full = time.perf_counter() - start
    if not rest.endswith(b"data: [DONE]\n\n"):
        raise RuntimeError(f"{url}: the stream did not end with [DONE]")
    return ttft, full


async def _measure(urls: dict[str, str], warmup: int, n: int) -> dict[str, np.ndarray]:
    plain = {"Content-Type": "application/json"}
    headers = {k: plain for k in urls}
    headers["router_keys"] = {**plain, "Authorization": f"Bearer {API_KEY}"}
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in urls}
    # One session (one kept-alive connection) per path, so none pays a handshake.
    sessions = {k: aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) for k in urls}
    order = list(urls)
    try:
        for i in range(warmup + n):
            # Rotate which path goes first so none always follows the same one.
            for key in order[i % len(order) :] + order[: i % len(order)]:
                url = urls[key] + "/v1/chat/completions"
                result = await _one(sessions[key], url, headers[key])
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
        urls = {name: procs[name].url for name in PATHS}
        uvloop.run(_measure(urls, warmup, 0))
        proxies = ("router", "router_keys", "floor")
        cpu = {name: _cpu_s(procs[name].pid) for name in proxies}
        ms = uvloop.run(_measure(urls, 0, n))
        cpu = {name: _cpu_s(procs[name].pid) - cpu[name] for name in proxies}
    out: dict[str, Any] = {
        "requests_per_path": n,
        "chunks_per_response": chunks,
        "host_load_avg_1m": round(load, 2),
        "router_cpu_ms_per_request": round(cpu["router"] / n * 1000, 3),
        "router_keys_cpu_ms_per_request": round(cpu["router_keys"] / n * 1000, 3),
        "floor_cpu_ms_per_request": round(cpu["floor"] / n * 1000, 3),
    }
    for i, metric in enumerate(("ttft", "full")):
        for q in (50, 99):
            direct = float(np.percentile(ms["direct"][:, i], q))
            out[f"{metric}_p{q}_direct_ms"] = round(direct, 3)
            for name, suffix in (("router", ""), ("router_keys", "_keys"), ("floor", "_floor")):
                via = float(np.percentile(ms[name][:, i], q))
                out[f"{metric}_p{q}_{name}_ms"] = round(via, 3)
                out[f"{metric}_p{q}_added{suffix}_ms"] = round(via - direct, 3)
    worst = max(out["ttft_p99_added_ms"], out["full_p99_added_ms"])
    worst_keys = max(out["ttft_p99_added_keys_ms"], out["full_p99_added_keys_ms"])
    # How much the Gate costs on top of the proxy: > 1 means keys on is slower.
    out["keys_on_over_off_added_p99"] = round(worst_keys / worst, 2) if worst > 0 else None
    # What the router adds beyond any aiohttp proxy on this host (the floor): its own cost.
    floor = max(out["ttft_p99_added_floor_ms"], out["full_p99_added_floor_ms"])
    out["router_over_floor_added_p99_ms"] = round(worst - floor, 3)
    out["floor_meets_target"] = floor < TARGET_ADDED_P99_MS
    out["target_added_p99_ms"] = TARGET_ADDED_P99_MS
    out["meets_target"] = worst < TARGET_ADDED_P99_MS
    out["meets_target_keys_on"] = worst_keys < TARGET_ADDED_P99_MS
    return out
