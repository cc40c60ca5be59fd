"""What the serving layer costs: one closed-loop workload through the daemon and in-process.

The same requests (token-id prompts, exact output lengths, greedy) run ``reps`` times on each
side, interleaved so that drift in the load of a shared host falls on both alike:

* engine: :class:`LLMEngine` in this process, ``concurrency`` requests in flight (a new one is
  added as soon as one finishes), stepped in a plain loop; it still detokenises every token,
  as the daemon's engine does;
* daemon: ``edgeinfer.daemon.main`` (the serving bench's ``both`` setup, pinned to the same
  cores) streaming ``/v1/completions`` over SSE to ``concurrency`` client streams.

The ratio is daemon tok/s over engine tok/s (median runs). With ``--py-spy FILE`` one extra
daemon run is sampled by ``py-spy record`` (every thread, native frames off; ``--py-spy-gil``:
only the thread holding the GIL), written as collapsed stacks, and summarised by thread and by
the serving layer's own functions.

    .venv/bin/python bench/engine.py --vs-daemon [--model default] [--py-spy /tmp/d.txt]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from edgeinfer.daemon.engine.config import EngineConfig
from edgeinfer.daemon.engine.llm_engine import LLMEngine
from edgeinfer.daemon.engine.sampling_params import SamplingParams
from serving_client import Target, drive, request_body, target_of, warm_up
from serving_setups import launch
from serving_workloads import Request, Workload

PROMPT_LEN, OUTPUT_RANGE = 128, (32, 48)


def workload(n: int, concurrency: int, seed: int) -> Workload:
    rng = random.Random(seed)
    requests = tuple(
        Request(0.0, PROMPT_LEN, rng.randint(*OUTPUT_RANGE), False, rng.randrange(1 << 30))
        for _ in range(n)
    )
    desc = f"{n} completions, prompts {PROMPT_LEN} tokens, outputs {OUTPUT_RANGE}"
    return Workload("vs-engine", desc, requests, concurrency, 0.0, 0.0)


def engine_run(engine: LLMEngine, target: Target, wl: Workload) -> dict[str, Any]:
    """``wl`` closed-loop in process: the prompts the daemon gets (same token ids)."""
    engine.block_manager.reset_prefix_cache()
    queue = [
        (str(i), request_body(target, r)[1]["prompt"], r.output_len)
        for i, r in enumerate(wl.requests)
    ][::-1]
    in_flight, tokens = 0, 0
    start = time.perf_counter()
    while queue or in_flight:
        while queue and in_flight < (wl.concurrency or len(wl.requests)):
            rid, prompt, n = queue.pop()
            engine.add_request(rid, prompt, SamplingParams(max_tokens=n, temperature=0.0,
                                                           ignore_eos=True))  # fmt: skip
            in_flight += 1
        for out in engine.step():
            tokens += len(out.new_token_ids)
            in_flight -= out.finished
    wall = time.perf_counter() - start
    return {"wall_s": wall, "output_tokens": tokens, "tok_s": tokens / wall}


def daemon_run(target: Target, wl: Workload) -> dict[str, Any]:
    start = time.perf_counter()
    results, _ = asyncio.run(drive(target, wl))
    wall = time.perf_counter() - start
    if errors := [r.error for r in results if r.error]:
        raise RuntimeError(f"daemon run failed: {errors[:3]}")
    tokens = sum(r.output_tokens for r in results)
    return {"wall_s": wall, "output_tokens": tokens, "tok_s": tokens / wall}


def profile_daemon(pid: int, target: Target, wl: Workload, out: Path, gil: bool) -> dict[str, Any]:
    """One daemon run under ``py-spy record`` (collapsed stacks, every thread; with ``gil``
    only the thread holding the GIL at each sample: who the others wait for)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    cmd = [spy, "record", "--pid", str(pid), "--format", "raw", "--threads", "--rate", "200",
           "--nonblocking", "--output", str(out), *(["--gil"] if gil else [])]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # py-spy attaches
    run = daemon_run(target, wl)
    proc.send_signal(signal.SIGINT)  # py-spy writes what it sampled and exits
    proc.wait(60)
    return run | {"profile": str(out), "summary": summarize_profile(out)}


def summarize_profile(path: Path) -> dict[str, Any]:
    """Samples per thread, and per leaf-most frame of the event loop thread's busy samples."""
    threads: Counter[str] = Counter()
    loop_frames: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        thread = frames[0]
        threads[thread] += int(count)
        if "edgeinfer-engine" in thread or "select" in frames[-1] or "epoll" in stack[-80:]:
            continue
        edge = [f for f in frames if "edgeinfer" in f or "aiohttp" in f or "orjson" in f]
        loop_frames[(edge or frames)[-1][:110]] += int(count)
    return {"threads": dict(threads.most_common(8)), "loop": dict(loop_frames.most_common(15))}


def compare(args: argparse.Namespace) -> dict[str, Any]:
    wl = workload(args.vs_daemon_requests, args.concurrency, args.seed)
    model = None if args.model in (None, ["default"]) else args.model[0]
    cfg = EngineConfig(model=model, dtype=args.dtype, device="cpu", num_threads=args.threads,
                       show_progress=False)  # fmt: skip
    engine = LLMEngine(cfg)
    # A timeout's SIGTERM unwinds through the finally below, which stops the daemon.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # The daemon runs as many torch threads as this process (its default: one per core).
    os.environ["EDGEINFER_NUM_THREADS"] = str(args.threads)
    daemon_args = argparse.Namespace(dtype=args.dtype, local_prefill_threshold=None)
    api, procs = launch("both", engine.model_dir, daemon_args)
    try:
        api.wait_http("/health", 600)
        target = asyncio.run(target_of(api.url, engine.model_dir))
        asyncio.run(warm_up(target, quick=False))
        engine_run(engine, target, workload(8, 8, args.seed + 1))  # warm this side too
        engine_runs, daemon_runs = [], []
        for _ in range(args.mixed_reps):
            engine_runs.append(engine_run(engine, target, wl))
            daemon_runs.append(daemon_run(target, wl))
            print(f"engine {engine_runs[-1]['tok_s']:.1f} tok/s, "
                  f"daemon {daemon_runs[-1]['tok_s']:.1f} tok/s", flush=True)  # fmt: skip
        profile = (
            profile_daemon(api.pid, target, wl, args.py_spy, args.py_spy_gil)
            if args.py_spy
            else None
        )
    finally:
        for p in procs:
            p.stop(timeout_s=15, group=True)
    e = statistics.median(r["tok_s"] for r in engine_runs)
    d = statistics.median(r["tok_s"] for r in daemon_runs)
    return {
        "workload": wl.description,
        "concurrency": wl.concurrency,
        "dtype": str(engine.runner.dtype).removeprefix("torch."),
        "engine_tok_s": e,
        "daemon_tok_s": d,
        "ratio": d / e,
        "engine_runs": engine_runs,
        "daemon_runs": daemon_runs,
        "pair_ratios": [b["tok_s"] / a["tok_s"] for a, b in zip(engine_runs, daemon_runs)],
        "profile": profile,
        "loadavg": os.getloadavg(),
    }
