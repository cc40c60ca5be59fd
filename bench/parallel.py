"""Tensor and pipeline parallelism on the CPU: throughput, step latency, all-reduce volume.

For each layout (TP x PP) on the same seeded checkpoint, float32, gloo over loopback:

* throughput: ``--requests`` prompts of ``--prompt`` tokens, ``--output`` tokens each, all
  submitted at once; output tokens/s and all tokens/s (prompt + output) over the wall time.
* step latency: median time of one decode step at batch 1 and at batch ``--requests``.
* communication, measured on rank 0: bytes all-reduced per token fed to the model against the
  analytic count ``(2 * layers_of_stage_0 + 1) * hidden * 4`` (o_proj and down_proj of each
  layer, plus the vocabulary-parallel embedding), and the share of the wall time rank 0 was
  blocked in collectives or receives.

The CPU cores are shared out between the ranks (``cores // ranks`` threads each), so on a
small machine a layout buys no compute, only communication: read the numbers as the cost of
the machinery, not as a speed-up. Writes JSON (bench/results/parallel.json by default).

    .venv/bin/python bench/parallel.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from edgeinfer.daemon.engine.config import EngineConfig
from edgeinfer.daemon.engine.llm_engine import LLMEngine
from edgeinfer.daemon.engine.parallel.comm import CommStats
from edgeinfer.daemon.engine.parallel.executor import ParallelExecutor
from edgeinfer.daemon.engine.parallel.layout import ParallelLayout
from edgeinfer.daemon.engine.sampling_params import SamplingParams
from edgeinfer.daemon.engine.tiny_checkpoint import build_tiny_checkpoint

RESULTS = Path(__file__).parent / "results" / "parallel.json"
# (tp, pp, threads per rank); None: the cores shared out. One process on one thread too, as
# the fair baseline for two single-threaded ranks on a busy two-core machine.
LAYOUTS = [(1, 1, None), (1, 1, 1), (2, 1, None), (1, 2, None), (2, 2, None)]
MODEL: dict[str, Any] = {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4,
         "intermediate_size": 1536, "vocab_size": 2048}  # fmt: skip


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def comm_stats(engine: LLMEngine) -> CommStats:
    runner = engine.runner
    return runner.shard.comm.stats if isinstance(runner, ParallelExecutor) else CommStats()


def decode_step_ms(engine: LLMEngine, batch: list[list[int]], steps: int) -> float:
    params = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
    for i, p in enumerate(batch):
        engine.add_request(f"lat-{len(batch)}-{i}", p, params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step()  # prefill everything first: only decode steps are timed
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def run_layout(
    ckpt: Path, tp: int, pp: int, threads: int | None, args: argparse.Namespace
) -> dict[str, Any]:
    cfg = EngineConfig(
        model=str(ckpt), device="cpu", num_kv_blocks=512, max_num_seqs=args.requests,
        max_num_batched_tokens=2048, tensor_parallel=tp, pipeline_parallel=pp,
        num_threads=threads or max(1, (os.cpu_count() or 1) // (tp * pp)),
        enable_prefix_caching=False,
    )  # fmt: skip
    start = time.perf_counter()
    engine = LLMEngine(cfg)
    startup_s = time.perf_counter() - start
    try:
        vocab = engine.model_config.vocab_size
        engine.generate(prompts(2, 16, vocab, 99), SamplingParams(max_tokens=4, temperature=0))
        work = prompts(args.requests, args.prompt, vocab, 0)
        params = SamplingParams(max_tokens=args.output, temperature=0, ignore_eos=True)
        stats = comm_stats(engine)
        before = (stats.all_reduce_bytes, stats.wait_s, engine.prompt_tokens_computed)
        start = time.perf_counter()
        engine.generate(work, params)
        wall = time.perf_counter() - start
        fed = engine.prompt_tokens_computed - before[2] + args.requests * (args.output - 1)
        reduced = stats.all_reduce_bytes - before[0]
        comm_share = (stats.wait_s - before[1]) / wall
        stage0 = len(ParallelLayout(tp, pp).stage_layers(0, engine.model_config.num_layers))
        analytic = (2 * stage0 + 1) * engine.model_config.hidden_size * 4 if tp > 1 else 0
        return {
            "tp": tp,
            "pp": pp,
            "threads": cfg.num_threads,
            "startup_s": startup_s,
            "output_tok_s": args.requests * args.output / wall,
            "total_tok_s": (args.requests * (args.prompt + args.output)) / wall,
            "step_ms_b1": decode_step_ms(engine, work[:1], args.steps),
            f"step_ms_b{args.requests}": decode_step_ms(engine, work, args.steps),
            "all_reduce_bytes_per_token": reduced / fed,
            "analytic_bytes_per_token": analytic,
            "rank0_comm_share": comm_share,
        }
    finally:
        if isinstance(engine.runner, ParallelExecutor):
            engine.runner.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--output", type=int, default=32)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="4 requests, shorter everything")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.requests, args.prompt, args.output, args.steps = 4, 64, 8, 6
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = build_tiny_checkpoint(Path(tmp) / "m", **MODEL)
        for tp, pp, threads in LAYOUTS:
            rows.append(run_layout(ckpt, tp, pp, threads, args))
            print(json.dumps(rows[-1]), flush=True)
    table = Table(title=f"parallel layouts on {os.cpu_count()} CPU cores (gloo, float32)")
    for col in rows[0]:
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(*(f"{v:.4g}" if isinstance(v, float) else str(v) for v in row.values()))
    Console(width=200).print(table)
    meta = {"model": MODEL, "cores": os.cpu_count(), "torch": torch.__version__, **vars(args)}
    meta["out"] = str(meta["out"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": meta, "results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
