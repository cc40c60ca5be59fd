"""Hostile-prompt benchmark (not a test): do huge posts stall the streams a daemon is serving?

A tiny daemon (``--model tiny``, a real process on free ports) serves 8 streams, each a chain of
streamed completions. The longest inter-token gap (ITL max, the gap between two content chunks
of one answer, on the client's clock) is measured twice for the same duration: with no other
client, then while 4 clients (another process, as if on other machines) post ~16 MiB prompts in
a loop (half chat, half completions; every one over the context, so each should get the
``context_length_exceeded`` 400). The ratio of the two maxima is the figure (target <= 1.5x),
next to how fast each hostile post was refused. Quiet and hostile phases alternate for a few
rounds and the median ratio is reported: on a shared machine one neighbour's burst can set a
maximum on its own.

Prints a summary and writes ``bench/results/hostile_prompts.json``.

    .venv/bin/python bench/hostile_prompts.py                  # 3 rounds of 2 x 15 s
    .venv/bin/python bench/hostile_prompts.py --rounds 1 --duration 10 --prompt-mib 8
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import itertools
import multiprocessing
import os
import platform
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from edgeinfer.shared.processes import ChildProcess, free_port, spawn
from serving_client import WORDS, content_of

RESULTS = Path(__file__).parent / "results" / "hostile_prompts.json"
STREAMS = 8
HOSTILE_CLIENTS = 4
# Long enough that a stream spends most of its life decoding, short enough to see many answers.
STREAM_TOKENS = 128


@dataclass
class Phase:
    gaps: list[float] = field(default_factory=list)  # every inter-token gap of every answer
    answers: int = 0
    errors: list[str] = field(default_factory=list)
    refusals: list[float] = field(default_factory=list)  # seconds from send to the 400
    # Seconds from the body's last byte handed to the kernel to the 400 (a queued post's
    # wait for the daemon's one large-body slot included).
    after_body: list[float] = field(default_factory=list)
    refusal_codes: dict[str, int] = field(default_factory=dict)
    daemon_cpu_s: float | None = None  # the daemon's CPU time (user + system) in the phase

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "answers": self.answers,
            "daemon_cpu_s": self.daemon_cpu_s,
            "token_gaps": len(self.gaps),
            "itl_max_s": max(self.gaps, default=float("nan")),
            "itl_p50_s": statistics.median(self.gaps) if self.gaps else float("nan"),
            "itl_p99_s": _quantile(self.gaps, 0.99),
            "errors": self.errors[:5],
        }
        if self.refusals:
            out |= {
                "hostile_posts": len(self.refusals),
                "refusal_p50_s": statistics.median(self.refusals),
                "refusal_max_s": max(self.refusals),
                "refusal_after_body_p50_s": statistics.median(self.after_body),
                "refusal_codes": self.refusal_codes,
            }
        return out


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


async def stream_until(
    session: aiohttp.ClientSession, url: str, model: str, seed: int, end: float, phase: Phase
) -> None:
    """Chain streamed completions until ``end``; record the gaps between content chunks."""
    rng = random.Random(seed)
    while time.monotonic() < end:
        body = {
            "model": model,
            "prompt": " ".join(rng.choice(WORDS) for _ in range(32)),
            "max_tokens": STREAM_TOKENS,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
        }
        stamps: list[float] = []
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                phase.errors.append(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                continue
            async for raw in resp.content:
                line = raw.strip()
                if line.startswith(b"data: {") and content_of(orjson.loads(line[6:])):
                    stamps.append(time.perf_counter())
        phase.gaps.extend(b - a for a, b in itertools.pairwise(stamps))
        phase.answers += 1


def hostile_bodies(model: str, mib: float) -> list[tuple[str, bytes]]:
    """A chat and a completion body, each carrying ~``mib`` MiB of words."""
    rng = random.Random(7)
    words: list[str] = []
    size, target = 0, int(mib * (1 << 20))
    while size < target:
        word = rng.choice(WORDS)
        words.append(word)
        size += len(word) + 1
    text = " ".join(words)
    chat = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 8}
    completion = {"model": model, "prompt": text, "max_tokens": 8}
    return [
        ("/v1/chat/completions", orjson.dumps(chat)),
        ("/v1/completions", orjson.dumps(completion)),
    ]


def post_until(url: str, path: str, body: Path, end: float, phase: Phase) -> None:
    """One hostile client: post the file ``body`` again and again until ``end``, timing each
    refusal. The body goes out with ``sendfile`` from the page cache: on a shared machine the
    hostile clients' own CPU must not be what slows the daemon down (a real attacker's copying
    happens on its own machines; loopback still costs the kernel's TCP work here)."""
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {parts.hostname}:{parts.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {body.stat().st_size}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    with body.open("rb") as file:
        while time.monotonic() < end:
            with socket.create_connection((parts.hostname, parts.port), timeout=900) as sock:
                sent = time.perf_counter()
                sock.sendall(head)
                sock.sendfile(file, 0)
                sent_all = time.perf_counter()
                resp = http.client.HTTPResponse(sock)
                resp.begin()
                answer = resp.read()
            phase.refusals.append(time.perf_counter() - sent)
            phase.after_body.append(time.perf_counter() - sent_all)
            code = str(resp.status)
            if resp.status != 200:
                code += ":" + str(orjson.loads(answer)["error"].get("code"))
            phase.refusal_codes[code] = phase.refusal_codes.get(code, 0) + 1


def _session() -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(total=None, sock_read=900)
    return aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))


async def run_streams(url: str, model: str, duration: float) -> Phase:
    phase = Phase()
    end = time.monotonic() + duration
    async with _session() as session:
        await asyncio.gather(
            *(stream_until(session, url, model, seed, end, phase) for seed in range(STREAMS))
        )
    return phase


def hostile_clients(
    url: str, model: str, mib: float, duration: float, ready: Any, results: Any
) -> None:
    """In a process of its own, like clients on other machines: the measuring client's event
    loop must not be the one busy sending 16 MiB bodies (sent from files: see post_until).
    And in a session of its own: with the kernel's autogroup scheduling (on by default on
    desktop and many server kernels) a session shares its CPU among its threads, so four
    sending threads in the measuring client's session would starve its event loop, and the
    gaps measured would be the client's, not the daemon's."""
    os.setsid()
    with tempfile.TemporaryDirectory(prefix="hostile-bodies-") as tmp:
        files = []
        for i, (path, body) in enumerate(hostile_bodies(model, mib)):
            file = Path(tmp) / f"{i}.json"
            file.write_bytes(body)
            files.append((path, file))
        ready.set()

        phase = Phase()
        end = time.monotonic() + duration
        clients = [
            threading.Thread(target=post_until, args=(url, *files[i % len(files)], end, phase))
            for i in range(HOSTILE_CLIENTS)
        ]
        for client in clients:
            client.start()
        for client in clients:
            client.join()
    results.put((phase.refusals, phase.after_body, phase.refusal_codes))


async def run_hostile_phase(url: str, model: str, args: argparse.Namespace) -> Phase:
    ctx = multiprocessing.get_context("spawn")
    ready, results = ctx.Event(), ctx.Queue()
    proc = ctx.Process(
        target=hostile_clients, args=(url, model, args.prompt_mib, args.duration, ready, results)
    )
    proc.start()
    try:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, ready.wait)
        phase = await run_streams(url, model, args.duration)
        received = await loop.run_in_executor(None, results.get)
        phase.refusals, phase.after_body, phase.refusal_codes = received
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    return phase


def start_daemon(workdir: Path) -> ChildProcess:
    port = free_port()
    cmd = [
        sys.executable, "-m", "edgeinfer.daemon.main", "--model", "tiny",
        "--host", "127.0.0.1", "--port", str(port), "--kv-port", str(free_port()),
        "--log-level", "warning",
    ]  # fmt: skip
    env = {"EDGEINFER_HEARTBEAT_PORT": str(free_port())}
    return spawn("daemon", cmd, workdir=workdir, url=f"http://127.0.0.1:{port}", env=env)


def cpu_seconds(pid: int | None) -> float | None:
    """A process's CPU time so far (Linux): how much work a phase cost the daemon, a figure
    that other load on a shared machine hardly moves, unlike a wall-clock gap."""
    if pid is None:
        return None
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def timed(pid: int | None, phase: Any) -> Phase:
    """Await ``phase`` (a coroutine returning a Phase) and note the daemon's CPU time in it."""
    before = cpu_seconds(pid)
    result: Phase = await phase
    after = cpu_seconds(pid)
    if before is not None and after is not None:
        result.daemon_cpu_s = after - before
    return result


async def measure(url: str, args: argparse.Namespace, pid: int | None) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.get(url + "/v1/models") as resp:
        model = (await resp.json())["data"][0]["id"]
    await run_streams(url, model, 2.0)  # warm-up: first calls pay for lazy initialisation
    rounds = []
    ratios: list[float] = []
    # Quiet and hostile phases alternate, so a neighbour's burst on a shared machine lands in
    # one round rather than deciding the figure.
    for i in range(args.rounds):
        quiet = await timed(pid, run_streams(url, model, args.duration))
        print(f"round {i + 1} quiet:   {_line(quiet)}", flush=True)
        hostile = await timed(pid, run_hostile_phase(url, model, args))
        print(f"round {i + 1} hostile: {_line(hostile)}", flush=True)
        ratio = max(hostile.gaps) / max(quiet.gaps)
        print(f"round {i + 1} ITL max ratio (hostile / quiet): {ratio:.2f}x", flush=True)
        rounds.append({"quiet": quiet.summary(), "hostile": hostile.summary(), "ratio": ratio})
        ratios.append(ratio)
    median = statistics.median(ratios)
    print(f"ITL max ratio, median of {args.rounds} rounds: {median:.2f}x  (target <= 1.5x)")
    return {
        "duration_s": args.duration,
        "prompt_mib": args.prompt_mib,
        "streams": STREAMS,
        "hostile_clients": HOSTILE_CLIENTS,
        "rounds": rounds,
        "itl_max_ratio_median": median,
    }


def _line(phase: Phase) -> str:
    s = phase.summary()
    line = (
        f"{s['answers']} answers, ITL p50 {s['itl_p50_s'] * 1e3:.1f} ms, "
        f"p99 {s['itl_p99_s'] * 1e3:.1f} ms, max {s['itl_max_s'] * 1e3:.1f} ms"
    )
    if phase.refusals:
        line += (
            f"; {s['hostile_posts']} hostile posts refused in p50 "
            f"{s['refusal_p50_s'] * 1e3:.0f} ms, max {s['refusal_max_s'] * 1e3:.0f} ms "
            f"(p50 {s['refusal_after_body_p50_s'] * 1e3:.0f} ms after the last byte) "
            f"{s['refusal_codes']}"
        )
    if phase.daemon_cpu_s is not None:
        line += f"; daemon CPU {phase.daemon_cpu_s:.1f} s"
    if phase.errors:
        line += f"; errors: {phase.errors[:2]}"
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=15.0, help="seconds per phase")
    parser.add_argument("--prompt-mib", type=float, default=15.5, help="size of a hostile prompt")
    parser.add_argument("--rounds", type=int, default=3, help="quiet + hostile phase pairs")
    parser.add_argument("--url", help="an already running daemon instead of starting one")
    args = parser.parse_args()
    proc = None
    url = args.url
    if url is None:
        proc = start_daemon(Path(tempfile.mkdtemp(prefix="hostile-")))
        url = proc.url
    try:
        if proc is not None:
            proc.wait_http("/health", 300)
        result = asyncio.run(measure(url, args, None if proc is None else proc.pid))
    finally:
        if proc is not None:
            proc.stop()
    result |= {"host": platform.node(), "python": platform.python_version()}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
