"""Serving benchmark (not a test): an OpenAI-API load generator against real server processes.

Each request streams (SSE) and is timed on the client: TTFT is send to first content chunk, ITL
the gaps between content chunks, E2E send to last chunk. Per run it reports p50/p99 of each
(ITL pooled over every gap of every request), request and output-token throughput, and goodput:
requests per second that met the workload's SLO (TTFT <= X and the request's own p99 ITL <= Y).
Outputs have exact lengths (``ignore_eos``), so every server does the same work.

Workloads (bench/serving_workloads.py): ``long`` (long prompts, Poisson arrivals), ``chat``
(chat completions, short prompts, Poisson), ``azure`` (the Azure LLM conversation trace,
stretched in time and shrunk in length to fit), ``c8`` (8 concurrent streams, closed loop).

Setups, all on the same two cores, started and killed by this script:

* ``both``: one colocated daemon on both cores (2 torch threads);
* ``pd``: a prefill daemon on the first core and a decode daemon on the second (1 thread each),
  the decode daemon prefilling remotely every prompt of ``--local-prefill-threshold`` tokens
  or more (the daemon's default, 512, unless the flag is given);
* ``vllm``: vLLM's OpenAI server (``--vllm-python``, a venv outside this repo) on both cores.

Prints tables and merges its results into ``bench/results/serving.json`` (``serving_quick.json``
with ``--quick``), keyed by workload and setup, so a partial rerun keeps the other figures.

    .venv/bin/python bench/serving.py                       # both + pd, every workload
    .venv/bin/python bench/serving.py --vs-vllm             # ... and vLLM on the same load
    .venv/bin/python bench/serving.py --setup both --workload c8 --url http://127.0.0.1:8000
    .venv/bin/python bench/serving.py --quick               # tiny model, about a minute
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
from rich.console import Console
from rich.table import Table

from edgeinfer.daemon.engine.default_model import resolve_model
from serving_workloads import WORKLOADS, Request, Workload, build

RESULTS_DIR = Path(__file__).parent / "results"
TRACE_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / "azure_llm_2023"
SETUPS = ("both", "pd", "vllm")
DEFAULT_RATES = {"long": 0.1, "chat": 0.6, "azure": 0.4}
# (TTFT s, per-request p99 ITL s): what a reader of a streamed answer on this hardware
# tolerates; long prompts get a longer TTFT budget because their prefill alone takes seconds.
DEFAULT_SLO = {"long": (10.0, 0.5), "chat": (3.0, 0.5), "azure": (6.0, 0.5), "c8": (5.0, 0.5)}
ITL_TARGET_RATIO = 2.0  # the target: pd's ITL p99 at least 2x lower than both's
# Common words, about one token each, for chat prompts of a chosen length.
WORDS = (
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on", "be",
    "by", "at", "this", "from", "or", "have", "an", "are", "not", "which", "but", "all", "can",
    "they", "more", "one", "had", "were", "will", "about", "if", "would", "their", "there",
    "what", "so", "up", "out", "time", "when", "who", "some", "could", "them", "other", "into",
    "than", "then", "its", "only", "now", "my", "new", "way", "see", "first", "people", "how",
    "may", "use", "very", "well", "because", "make", "water", "long", "just", "over", "after",
    "little", "most", "world",
)  # fmt: skip

# Wide enough for the results table when the output goes to a log file.
console = Console(width=150)


# ---------------------------------------------------------------------------------- client


@dataclass
class Result:
    start: float  # perf_counter when the request was sent
    ttft_s: float = float("nan")
    e2e_s: float = float("nan")
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None

    @property
    def end(self) -> float:
        return self.start + self.e2e_s


@dataclass(frozen=True)
class Target:
    url: str
    model: str  # the id /v1/models reports
    vocab_size: int


def request_body(target: Target, req: Request) -> tuple[str, dict[str, Any]]:
    """The endpoint and JSON body for ``req``; its content is a pure function of ``req.seed``."""
    rng = random.Random(req.seed)
    common = {
        "model": target.model,
        "max_tokens": req.output_len,
        "ignore_eos": True,  # exact output lengths: every server does the same work
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if req.chat:
        words = " ".join(rng.choice(WORDS) for _ in range(req.prompt_len))
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": words}]}
    # Token ids from the middle of the vocabulary: the low ids are specials and byte tokens.
    lo, hi = target.vocab_size // 64, target.vocab_size * 3 // 4
    prompt = [rng.randrange(lo, hi) for _ in range(req.prompt_len)]
    return "/v1/completions", {**common, "prompt": prompt}


def content_of(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


async def send(session: aiohttp.ClientSession, target: Target, req: Request) -> Result:
    path, body = request_body(target, req)
    res = Result(start=time.perf_counter())
    stamps: list[float] = []
    try:
        async with session.post(target.url + path, json=body) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = orjson.loads(line[6:])
                now = time.perf_counter()
                if "error" in chunk:
                    res.error = str(chunk["error"])[:200]
                    return res
                if content_of(chunk):
                    stamps.append(now)
                if usage := chunk.get("usage"):
                    res.prompt_tokens = usage["prompt_tokens"]
                    res.output_tokens = usage["completion_tokens"]
    except aiohttp.ClientError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    if not stamps:
        res.error = "no content"
        return res
    res.ttft_s = stamps[0] - res.start
    res.e2e_s = stamps[-1] - res.start
    res.itl_s = [b - a for a, b in itertools.pairwise(stamps)]
    return res


async def drive(target: Target, workload: Workload) -> tuple[list[Result], float]:
    """Send the workload (open loop at its arrival times, or closed loop); return results and
    the largest lag of a send behind its scheduled time (a busy client skews open-loop TTFT)."""
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as session:
        loop = asyncio.get_running_loop()
        if workload.concurrency is not None:
            queue = list(reversed(workload.requests))
            results: list[Result] = []

            async def stream() -> None:
                while queue:
                    results.append(await send(session, target, queue.pop()))

            await asyncio.gather(*(stream() for _ in range(workload.concurrency)))
            return results, 0.0
        t0, lag, tasks = loop.time(), 0.0, []
        for req in workload.requests:
            if (delay := t0 + req.arrival_s - loop.time()) > 0:
                await asyncio.sleep(delay)
            lag = max(lag, loop.time() - t0 - req.arrival_s)
            tasks.append(asyncio.create_task(send(session, target, req)))
        return list(await asyncio.gather(*tasks)), lag


# --------------------------------------------------------------------------------- metrics


def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(workload: Workload, results: list[Result], lag: float) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    duration = max(r.end for r in ok) - min(r.start for r in results) if ok else float("nan")
    ttft = [r.ttft_s for r in ok]
    e2e = [r.e2e_s for r in ok]
    itl = [g for r in ok for g in r.itl_s]
    good = [
        r
        for r in ok
        if r.ttft_s <= workload.slo_ttft_s
        and (len(r.itl_s) == 0 or float(np.percentile(r.itl_s, 99)) <= workload.slo_itl_s)
    ]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "output_tokens": out_tokens,
        "req_s": len(ok) / duration,
        "output_tok_s": out_tokens / duration,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "itl_p50_s": pct(itl, 50),
        "itl_p99_s": pct(itl, 99),
        # The longest stall: a p99 misses prefill stalls when they are under 1% of all gaps.
        "itl_max_s": max(itl, default=None),
        "e2e_p50_s": pct(e2e, 50),
        "e2e_p99_s": pct(e2e, 99),
        "slo": {"ttft_s": workload.slo_ttft_s, "itl_p99_s": workload.slo_itl_s},
        "goodput_req_s": len(good) / duration,
        "slo_attainment": len(good) / len(results),
        "max_send_lag_s": lag,
    }


# --------------------------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    url: str
    kv_port: int = 0  # a prefill daemon's, for its decode peer

    def stop(self) -> None:
        """SIGTERM, then SIGKILL, to this process's own group: vLLM forks an engine process
        that would outlive its parent."""
        if self.popen.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(wait_s)
                return


def spawn(
    name: str, cmd: list[str], env: dict[str, str], port: int, workdir: Path, kv_port: int = 0
) -> Proc:
    log = workdir / f"{name}.log"
    with log.open("wb") as out:
        popen = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,  # its own process group, which stop() signals
        )
    return Proc(name, popen, log, f"http://127.0.0.1:{port}", kv_port)


async def wait_healthy(proc: Proc, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while time.monotonic() < deadline:
            if proc.popen.poll() is not None:
                tail = proc.log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{proc.name} exited {proc.popen.returncode}:\n{tail}")
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with session.get(proc.url + "/health") as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.5)
    raise TimeoutError(f"{proc.name} not healthy after {timeout_s}s; see {proc.log}")


def cores() -> tuple[str, str, str]:
    """The first two cores this process may run on: (first, second, both) for taskset."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        raise SystemExit("the serving comparison needs two cores")
    a, b = str(allowed[0]), str(allowed[1])
    return a, b, f"{a},{b}"


def daemon_cmd(model_dir: Path, core: str, port: int, kv_port: int, *args: str) -> list[str]:
    return [
        "taskset", "-c", core, sys.executable, "-m", "edgeinfer.daemon.main",
        "--model", str(model_dir), "--host", "127.0.0.1",
        "--port", str(port), "--kv-port", str(kv_port), *args,
    ]  # fmt: skip


def launch(setup: str, model_dir: Path, args: argparse.Namespace) -> tuple[Proc, list[Proc]]:
    """Spawn ``setup``'s processes without waiting for them; return the API process and all."""
    first, second, both = cores()
    workdir = Path(tempfile.mkdtemp(prefix=f"serving-{setup}-"))
    procs: list[Proc] = []

    def daemon(name: str, core: str, threads: int, *flags: str) -> Proc:
        port, kv_port = free_port(), free_port()
        env = {"EDGEINFER_HEARTBEAT_PORT": str(free_port()), "EDGEINFER_NUM_THREADS": str(threads)}
        cmd = daemon_cmd(model_dir, core, port, kv_port, *flags)
        procs.append(spawn(name, cmd, env, port, workdir, kv_port))
        return procs[-1]

    if setup == "both":
        api = daemon("both", both, 2, "--role", "both")
    elif setup == "pd":
        prefill = daemon("prefill", first, 1, "--role", "prefill")
        threshold = [] if args.local_prefill_threshold is None else [
            "--local-prefill-threshold", str(args.local_prefill_threshold)]  # fmt: skip
        # The decode daemon's ZeroMQ client reconnects until the prefill daemon listens.
        api = daemon(
            "decode", second, 1, "--role", "decode",
            "--prefill-peer", f"tcp://127.0.0.1:{prefill.kv_port}", *threshold,
        )  # fmt: skip
    elif setup == "vllm":
        port = free_port()
        cmd = [
            "taskset", "-c", both, args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir), "--dtype", "float32",
            "--host", "127.0.0.1", "--port", str(port),
        ]  # fmt: skip
        env = {
            "VLLM_CPU_KVCACHE_SPACE": "2",
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            # vLLM would keep one of the two cores for its API server and compute on the
            # other; edgeinfer's `both` computes on both, so vLLM gets both too.
            "VLLM_CPU_OMP_THREADS_BIND": both,
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        }
        procs.append(spawn("vllm", cmd, env, port, workdir))
        api = procs[-1]
    else:
        raise ValueError(f"unknown setup {setup!r}")
    return api, procs


async def target_of(url: str, model_dir: Path) -> Target:
    async with aiohttp.ClientSession() as session, session.get(url + "/v1/models") as resp:
        model = (await resp.json())["data"][0]["id"]
    config = orjson.loads((model_dir / "config.json").read_bytes())
    return Target(url, model, int(config["vocab_size"]))


async def warm_up(target: Target, quick: bool) -> None:
    """One short chat and one long completion, unmeasured: first calls pay for lazy
    initialisation (and on pd, for the first KV connection)."""
    long_prompt = 128 if quick else 640  # over the decode daemon's default 512 threshold
    warm = Workload(
        "warm-up", "", (Request(0, 16, 4, True, 1), Request(0, long_prompt, 4, False, 2)), 1, 0, 0
    )
    results, _ = await drive(target, warm)
    if errors := [r.error for r in results if r.error]:
        raise RuntimeError(f"warm-up failed against {target.url}: {errors}")


async def metric(url: str, name: str, labels: str = "") -> float:
    """Sum of a Prometheus sample (0 for servers without it)."""
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as resp:
        text = await resp.text()
    total = 0.0
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] == name and labels in head:
            total += float(value)
    return total


# ----------------------------------------------------------------------------------- report


def load_results(path: Path) -> dict[str, Any]:
    return orjson.loads(path.read_bytes()) if path.exists() else {"meta": {}, "runs": {}}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def comparisons(runs: dict[str, Any]) -> dict[str, Any]:
    """Ratios between setups on the same workload: >1 means the second-named setup is better
    for latencies (``x_over_y`` = x's latency / y's) and the first-named for throughputs."""
    out: dict[str, Any] = {}
    for wl in WORKLOADS:
        b, pd, vl = (runs.get(f"{wl}/{s}") for s in SETUPS)
        if b and pd:
            out[f"{wl}/both_vs_pd"] = {
                "itl_p99_both_over_pd": ratio(b["itl_p99_s"], pd["itl_p99_s"]),
                "itl_max_both_over_pd": ratio(b.get("itl_max_s"), pd.get("itl_max_s")),
                "ttft_p50_both_over_pd": ratio(b["ttft_p50_s"], pd["ttft_p50_s"]),
                "e2e_p50_both_over_pd": ratio(b["e2e_p50_s"], pd["e2e_p50_s"]),
                "output_tok_s_pd_over_both": ratio(pd["output_tok_s"], b["output_tok_s"]),
                "goodput_pd_over_both": ratio(pd["goodput_req_s"], b["goodput_req_s"]),
            }
            itl = out[f"{wl}/both_vs_pd"]["itl_p99_both_over_pd"]
            out[f"{wl}/both_vs_pd"]["itl_target_met"] = itl is not None and itl >= ITL_TARGET_RATIO
        if b and vl:
            out[f"{wl}/both_vs_vllm"] = {
                "output_tok_s_edgeinfer_over_vllm": ratio(b["output_tok_s"], vl["output_tok_s"]),
                "ttft_p50_vllm_over_edgeinfer": ratio(vl["ttft_p50_s"], b["ttft_p50_s"]),
                "itl_p50_vllm_over_edgeinfer": ratio(vl["itl_p50_s"], b["itl_p50_s"]),
            }
    return out


def fmt(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def print_tables(runs: dict[str, Any], comps: dict[str, Any]) -> None:
    table = Table(title="Serving: client-side latencies (TTFT, E2E in s; ITL in ms)")
    for col in ("workload", "setup", "ok/n", "req/s", "out tok/s", "TTFT p50", "TTFT p99",
                "ITL p50", "ITL p99", "ITL max", "E2E p50", "E2E p99", "goodput", "SLO %"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("workload", "setup") else "right")
    for key, r in runs.items():
        wl, setup = key.split("/")
        table.add_row(
            wl, setup, f"{r['requests'] - r['failed']:.0f}/{r['requests']:.0f}",
            fmt(r["req_s"], digits=3), fmt(r["output_tok_s"], digits=1),
            fmt(r["ttft_p50_s"]), fmt(r["ttft_p99_s"]),
            fmt(r["itl_p50_s"], 1e3, 0), fmt(r["itl_p99_s"], 1e3, 0),
            fmt(r.get("itl_max_s"), 1e3, 0),
            fmt(r["e2e_p50_s"]), fmt(r["e2e_p99_s"]),
            fmt(r["goodput_req_s"], digits=3), fmt(r["slo_attainment"], 100, 0),
        )  # fmt: skip
    console.print(table)
    if comps:
        ct = Table(title="Ratios (latency: x_over_y > 1 means y is faster)")
        ct.add_column("comparison")
        ct.add_column("ratios")
        for key, vals in comps.items():
            ct.add_row(
                key,
                "  ".join(f"{k}={v if isinstance(v, bool) else fmt(v)}" for k, v in vals.items()),
            )
        console.print(ct)


# ------------------------------------------------------------------------------------- main


async def measure(target: Target, wl: Workload) -> dict[str, Any]:
    kv_name = "edgeinfer_kv_transfer_bytes_total"
    kv_before = await metric(target.url, kv_name, "received")
    t = time.monotonic()
    results, lag = await drive(target, wl)
    summary = summarize(wl, results, lag)
    # Proof that pd really prefilled remotely (0 on both and vLLM).
    summary["kv_bytes_received"] = await metric(target.url, kv_name, "received") - kv_before
    summary.update(workload=wl.name, description=wl.description, offered_req_s=wl.offered_rate,
                   loadavg=os.getloadavg(), wall_s=time.monotonic() - t)  # fmt: skip
    failed = f", {summary['failed']} failed: {summary['errors']}" if summary["failed"] else ""
    console.print(
        f"  {summary['wall_s']:.0f}s, {summary['output_tok_s']:.1f} tok/s, TTFT p50 "
        f"{fmt(summary['ttft_p50_s'])}s, ITL p99 {fmt(summary['itl_p99_s'], 1e3, 0)}ms{failed}"
    )
    return summary


KEY_FIGURES = ("output_tok_s", "ttft_p50_s", "itl_p99_s", "e2e_p50_s", "goodput_req_s")


def combine(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's figures from its repeats: the median of each number (a shared machine
    perturbs single runs), the worst failure count, and the key figures of every repeat."""
    out = dict(reps[0])
    for key, value in reps[0].items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            values = [r[key] for r in reps if r[key] is not None]
            out[key] = statistics.median(values) if values else None
    out["failed"] = max(r["failed"] for r in reps)
    out["errors"] = sorted({e for r in reps for e in r["errors"]})[:5]
    out["repeats"] = [{k: r[k] for k in KEY_FIGURES} for r in reps]
    return out


def save(
    out_path: Path, stored: dict[str, Any], meta: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Write the runs (sorted), their comparisons and this invocation's metadata."""
    runs = dict(sorted(stored["runs"].items(), key=lambda kv: (
        WORKLOADS.index(kv[1]["workload"]), SETUPS.index(kv[1]["setup"]))))  # fmt: skip
    comps = comparisons(runs)
    doc = {
        "meta": {**stored["meta"], "last_run": {**meta, "loadavg_end": os.getloadavg()}},
        "runs": runs,
        "comparisons": comps,
    }
    out_path.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n")
    return runs, comps


async def run(args: argparse.Namespace) -> None:
    model_dir = resolve_model(args.model or ("tiny" if args.quick else None))
    setups = SETUPS if "all" in args.setup else args.setup
    if args.vs_vllm and "vllm" not in setups:
        setups = [*setups, "vllm"]
    # The tiny model serves ~50x faster; the smoke run need not idle between arrivals.
    rates = {k: getattr(args, f"{k}_rate") * (4 if args.quick else 1) for k in DEFAULT_RATES}
    slo = {
        wl: (args.slo_ttft_s or ttft, (args.slo_itl_ms or itl * 1e3) / 1e3)
        for wl, (ttft, itl) in DEFAULT_SLO.items()
    }
    workloads = build(
        args.workload, quick=args.quick, seed=args.seed, rates=rates,
        concurrency=args.concurrency, trace_dir=args.trace_dir, trace=args.trace, slo=slo,
    )  # fmt: skip
    out_path = args.out or RESULTS_DIR / ("serving_quick.json" if args.quick else "serving.json")
    stored = load_results(out_path)
    started = time.monotonic()
    meta = {
        "argv": sys.argv[1:],
        "model_dir": str(model_dir),
        "setups": list(setups),
        "workloads": [w.name for w in workloads],
        "seed": args.seed,
        "cores": cores()[2],
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
    }
    runs: dict[str, Any] = {}
    comps: dict[str, Any] = {}
    reps: dict[str, list[dict[str, Any]]] = {}
    procs: list[Proc] = []
    try:
        apis: dict[str, str] = {}
        for setup in setups:
            if args.url:
                apis[setup] = args.url
            else:
                api, started_procs = launch(setup, model_dir, args)
                procs += started_procs
                apis[setup] = api.url
        # Every setup starts at once (vLLM compiles for minutes) and stays up, idle, while
        # the others run: the setups then take turns on each workload, so drift in the load
        # of this shared machine falls on all of them alike.
        await asyncio.gather(*(wait_healthy(p, 900) for p in procs))
        targets = {setup: await target_of(url, model_dir) for setup, url in apis.items()}
        for target in targets.values():
            await warm_up(target, args.quick)
        for rep in range(args.repeat):
            for wl in workloads:
                for setup, target in targets.items():
                    console.print(
                        f"[bold]{setup}[/] {wl.name} ({rep + 1}/{args.repeat}): "
                        f"{len(wl.requests)} requests, {wl.description}"
                    )
                    summary = await measure(target, wl)
                    summary["setup"] = setup
                    reps.setdefault(f"{wl.name}/{setup}", []).append(summary)
                    # Saved after every run: a crash or a kill an hour in keeps what was measured.
                    stored["runs"].update({key: combine(rs) for key, rs in reps.items()})
                    meta["total_s"] = time.monotonic() - started
                    runs, comps = save(out_path, stored, meta)
    finally:
        for proc in procs:
            proc.stop()
    print_tables(runs, comps)
    console.print(f"wrote {out_path}")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--setup",
        type=lambda s: s.split(","),
        default=["both", "pd"],
        help="comma-separated: both, pd, vllm, or all (default both,pd)",
    )
    p.add_argument("--vs-vllm", action="store_true", help="add the vllm setup")
    p.add_argument(
        "--workload",
        type=lambda s: s.split(","),
        default=list(WORKLOADS),
        help=f"comma-separated from {','.join(WORKLOADS)} (default all)",
    )
    p.add_argument("--quick", action="store_true", help="tiny model, few short requests")
    p.add_argument("--model", help="checkpoint directory (default: the built-in SmolLM2-135M)")
    p.add_argument("--url", help="drive an already running server instead of starting --setup")
    p.add_argument(
        "--vllm-python",
        default="/tmp/vllm-venv/bin/python",
        help="python of the venv with vllm-cpu installed",
    )
    p.add_argument(
        "--local-prefill-threshold",
        type=int,
        help="pd: the decode daemon's --local-prefill-threshold (default: its own)",
    )
    p.add_argument("--concurrency", type=int, default=8, help="streams of the c8 workload")
    for wl, rate in DEFAULT_RATES.items():
        p.add_argument(f"--{wl}-rate", type=float, default=rate, help=f"{wl}: mean req/s")
    p.add_argument("--trace", choices=("conv", "code"), default="conv")
    p.add_argument("--trace-dir", type=Path, default=TRACE_DIR)
    p.add_argument("--slo-ttft-s", type=float, help="override every workload's TTFT SLO")
    p.add_argument("--slo-itl-ms", type=float, help="override every workload's p99 ITL SLO")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=1, help="runs of each workload (medians kept)")
    p.add_argument("--out", type=Path, help="results JSON (default bench/results/serving.json)")
    args = p.parse_args()
    bad = set(args.setup) - {*SETUPS, "all"}
    if bad:
        p.error(f"unknown setup(s) {sorted(bad)}")
    if args.url and len(args.setup) != 1:
        p.error("--url drives one server: name its --setup (used as the label)")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
