"""End-to-end engine benchmark against transformers ``generate()`` (not a test).

Per model, on the same weights, dtype and thread count:

* mixed workload: seeded random requests (prompts 16-512 tokens, outputs 16-256, exact
  lengths). The engine gets them all at once; transformers runs them in static batches of 8
  with left padding, each batch generating to the longest output among its members, which is
  how a user batches ``generate()``. Only requested tokens count as output. The two sides
  run ``--mixed-reps`` times, interleaved (engine, HF, engine, HF, ...), and each side's median
  run is reported: on a shared host the speed drifts by 20-40% within minutes, and one run of
  each side, back to back, turns that drift into the ratio. The engine's prefix cache is
  emptied before each of its runs, so a repetition finds none of the last one's blocks.
* batch 1: a 128-token prompt and 128 output tokens; time per decode token (first token to
  last, so prefill is excluded) beside the memory-bandwidth floor, the weight bytes a decode
  token must read over a measured copy bandwidth.

Prints a table and writes JSON (bench/results/engine.json by default).

    .venv/bin/python bench/engine.py [--model tiny|default|DIR ...] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer
from transformers.utils import logging as hf_logging

import engine_vs_daemon
from edgeinfer.daemon.engine.config import EngineConfig
from edgeinfer.daemon.engine.llm_engine import LLMEngine
from edgeinfer.daemon.engine.sampling_params import SamplingParams
from engine_report import print_notes, print_table, rows

RESULTS = Path(__file__).parent / "results" / "engine.json"
PROMPT_RANGE, OUTPUT_RANGE = (16, 512), (16, 256)
HF_BATCH = 8
B1_PROMPT, B1_OUTPUT = 128, 128
COPY_BYTES = 512 << 20  # far above any L3, so the copy runs at DRAM speed


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    output_len: int


@dataclass
class Timing:
    wall_s: float
    cpu_s: float  # process CPU time, all threads: less sensitive than wall to other tenants


def timed(fn: Callable[[], Any]) -> tuple[Any, Timing]:
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, Timing(time.perf_counter() - wall, time.process_time() - cpu)


def make_workload(n: int, vocab: int, seed: int) -> list[Request]:
    # Lengths and ids come from separate streams so every model gets the same request shapes.
    lengths, ids = random.Random(seed), random.Random(seed + 1_000_003)
    shapes = [(lengths.randint(*PROMPT_RANGE), lengths.randint(*OUTPUT_RANGE)) for _ in range(n)]
    return [Request([ids.randrange(vocab) for _ in range(p)], o) for p, o in shapes]


def copy_gbps(reps: int = 7) -> float:
    """Best-of-``reps`` DRAM bandwidth of a large tensor copy, counting bytes read plus bytes
    written (the STREAM convention): the rate at which a decode step could stream weights."""
    src = torch.ones(COPY_BYTES // 4, dtype=torch.float32)
    dst = torch.zeros_like(src)  # touched, so page faults stay out of the timing
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * COPY_BYTES / best / 1e9


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode token reads: every parameter once (``parameters()`` skips
    tied duplicates), except an untied input embedding, of which a token reads one row."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    if embed is not model.get_output_embeddings().weight:
        total -= embed.numel() * embed.element_size()
    return total


# ---- engine ------------------------------------------------------------------------------
def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def engine_mixed(engine: LLMEngine, workload: list[Request]) -> dict[str, Any]:
    engine.block_manager.reset_prefix_cache()  # a repetition must not hit the last one's blocks
    before = engine.stats()
    done, t = timed(
        lambda: engine.generate(
            [r.prompt for r in workload], [greedy(r.output_len) for r in workload]
        )
    )
    tokens = sum(len(c.token_ids) for c in done)
    assert tokens == sum(r.output_len for r in workload), "the engine's output lengths are off"
    after = engine.stats()
    return asdict(t) | {
        "output_tokens": tokens,
        "tok_s": tokens / t.wall_s,
        "preemptions": after.num_preemptions - before.num_preemptions,
        "prefix_cache_hits": after.prefix_cache_hits - before.prefix_cache_hits,
        "kv_blocks_total": after.kv_blocks_total,
    }


def engine_decode(engine: LLMEngine, prompt: list[int], n: int) -> tuple[float, list[int]]:
    """Seconds per decode token at batch 1 (first token to last) and the tokens."""
    engine.add_request("b1", prompt, greedy(n))
    stamps: list[float] = []
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids:
                stamps.append(time.perf_counter())
                tokens.extend(out.new_token_ids)
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1), tokens


# ---- transformers ------------------------------------------------------------------------
class _Stamps(BaseStreamer):
    """generate() calls ``put`` once with the prompt, then once per new token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_generate(
    hf: Any, prompts: list[list[int]], new_tokens: int, streamer: BaseStreamer | None = None
) -> torch.Tensor:
    """Left-padded batch; ``min_new_tokens`` keeps EOS from ending any row early."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    with torch.inference_mode():
        out = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            streamer=streamer,
        )
    return out[:, width:]


def hf_mixed(hf: Any, workload: list[Request], budget_s: float | None) -> dict[str, Any]:
    """Static batches of 8 in request order. With ``budget_s``, batches stop once that much
    wall time is spent and the rest is extrapolated at the mean time per batch run: requests
    are i.i.d., so every batch is a fair sample of the workload."""
    batches = [workload[i : i + HF_BATCH] for i in range(0, len(workload), HF_BATCH)]
    walls: list[float] = []
    cpus: list[float] = []
    useful = generated = 0
    for b in batches:
        if budget_s is not None and walls and sum(walls) >= budget_s:
            break
        steps = max(r.output_len for r in b)
        out, t = timed(lambda b=b, steps=steps: hf_generate(hf, [r.prompt for r in b], steps))
        walls.append(t.wall_s)
        cpus.append(t.cpu_s)
        generated += out.numel()
        useful += sum(r.output_len for r in b)
    scale = len(batches) / len(walls)
    tokens = sum(r.output_len for r in workload)
    return {
        "wall_s": sum(walls) * scale,
        "cpu_s": sum(cpus) * scale,
        "batch_wall_s": walls,
        "batches_run": len(walls),
        "batches_total": len(batches),
        "extrapolated": len(walls) < len(batches),
        "output_tokens": tokens,
        "tok_s": tokens / (sum(walls) * scale),
        "padding_waste": 1 - useful / generated,  # generated tokens nobody asked for
    }


def hf_decode(hf: Any, prompt: list[int], n: int) -> tuple[float, list[int]]:
    stamps = _Stamps()
    tokens = hf_generate(hf, [prompt], n, stamps)[0].tolist()
    first, last = stamps.times[1], stamps.times[-1]  # times[0] is the prompt
    return (last - first) / (n - 1), tokens


# ---- one model ---------------------------------------------------------------------------
def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median wall time (the upper one of an even count), with every run's wall."""
    ranked = sorted(runs, key=lambda r: r["wall_s"])
    return ranked[len(ranked) // 2] | {"wall_s_samples": [r["wall_s"] for r in runs]}


def mixed(
    engine: LLMEngine, hf: Any, workload: list[Request], reps: int, budget_s: float | None
) -> dict[str, Any]:
    """Both sides ``reps`` times, interleaved, so host drift lands on both alike."""
    engine_runs, hf_runs = [], []
    for _ in range(reps):
        engine_runs.append(engine_mixed(engine, workload))
        hf_runs.append(hf_mixed(hf, workload, budget_s))
    e, h = median_run(engine_runs), median_run(hf_runs)
    return {
        "engine": e,
        "hf": h,
        "ratio": e["tok_s"] / h["tok_s"],
        "pair_ratios": [a["wall_s"] / b["wall_s"] for a, b in zip(hf_runs, engine_runs)],
    }


def repeat(reps: int, fn: Callable[[], tuple[float, list[int]]]) -> tuple[list[float], list[int]]:
    """Every run's seconds per token, and the last run's tokens (they are greedy: all equal)."""
    samples, tokens = [], []
    for _ in range(reps):
        s, tokens = fn()
        samples.append(s)
    return samples, tokens


def bench_model(spec: str, args: argparse.Namespace, gbps: float, console: Console) -> dict:
    cfg = EngineConfig(
        model=None if spec == "default" else spec,
        dtype=args.dtype,
        device="cpu",
        num_threads=args.threads,
        show_progress=False,
    )
    engine = LLMEngine(cfg)
    dtype = engine.runner.dtype
    hf = AutoModelForCausalLM.from_pretrained(engine.model_dir, dtype=dtype).eval()
    vocab = engine.model_config.vocab_size
    workload = make_workload(args.num_requests, vocab, args.seed)
    warm = make_workload(4, vocab, args.seed + 1)
    rng = random.Random(args.seed + 2)
    b1_prompt = [rng.randrange(vocab) for _ in range(B1_PROMPT)]

    # Warm both sides up (allocator growth, lazy inits) so neither pays first-call costs.
    engine.generate([r.prompt for r in warm], greedy(8))
    hf_generate(hf, [r.prompt for r in warm], 8)

    console.print(
        f"[bold]{spec}[/bold]: mixed workload, engine and transformers, {args.mixed_reps} runs each"
    )
    mixed_result = mixed(engine, hf, workload, args.mixed_reps, args.hf_budget)
    console.print(f"[bold]{spec}[/bold]: batch 1 decode")
    e_b1, e_tokens = repeat(args.b1_reps, lambda: engine_decode(engine, b1_prompt, B1_OUTPUT))
    h_b1, h_tokens = repeat(args.b1_reps, lambda: hf_decode(hf, b1_prompt, B1_OUTPUT))
    agree = next((i for i, (a, b) in enumerate(zip(e_tokens, h_tokens)) if a != b), B1_OUTPUT)
    weight_bytes = decode_weight_bytes(hf)
    floor = weight_bytes / (gbps * 1e9)
    return {
        "model": spec,
        "model_dir": str(engine.model_dir),
        "dtype": str(dtype).removeprefix("torch."),
        "num_params": sum(p.numel() for p in hf.parameters()),
        "workload": {
            "num_requests": len(workload),
            "prompt_tokens": sum(len(r.prompt) for r in workload),
            "output_tokens": sum(r.output_len for r in workload),
        },
        "mixed": mixed_result,
        "batch1": {
            "prompt_tokens": B1_PROMPT,
            "output_tokens": B1_OUTPUT,
            "engine_s_per_token": statistics.median(e_b1),
            "hf_s_per_token": statistics.median(h_b1),
            "engine_samples": e_b1,
            "hf_samples": h_b1,
            "floor_s_per_token": floor,
            "decode_weight_bytes": weight_bytes,
            "greedy_tokens_agree": agree,  # leading tokens equal between engine and HF
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        action="append",
        help="tiny, default or a checkpoint directory; repeatable (default: tiny and default)",
    )
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke run: 16 requests, 1 rep")
    parser.add_argument(
        "--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="float32"
    )
    threads = len(os.sched_getaffinity(0))
    parser.add_argument("--threads", type=int, default=threads, help="torch threads, both sides")
    parser.add_argument("--b1-reps", type=int, default=3, help="batch-1 runs per side (median)")
    parser.add_argument(
        "--mixed-reps",
        type=int,
        default=3,
        help="mixed-workload runs per side, interleaved (median)",
    )
    parser.add_argument(
        "--hf-budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop each HF mixed run after this much wall time and extrapolate the "
        "remaining batches (default: run them all)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--vs-daemon",
        action="store_true",
        help="instead: the same closed-loop load through the daemon (SSE) and in-process "
        "(see engine_vs_daemon.py); --mixed-reps runs each",
    )
    parser.add_argument("--vs-daemon-requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8, help="--vs-daemon streams")
    parser.add_argument("--py-spy", type=Path, help="--vs-daemon: profile one more daemon run")
    parser.add_argument("--py-spy-gil", action="store_true", help="... sampling the GIL holder")
    args = parser.parse_args()
    if args.vs_daemon:
        result = engine_vs_daemon.compare(args)
        print(json.dumps({k: v for k, v in result.items() if not k.endswith("runs")}, indent=2))
        out = args.out if args.out != RESULTS else RESULTS.with_name("engine_vs_daemon.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result | {"loadavg_end": os.getloadavg()}, indent=2) + "\n")
        return
    if args.quick:
        args.num_requests, args.b1_reps, args.mixed_reps = min(args.num_requests, 16), 1, 1
    torch.set_num_threads(args.threads)
    # Rich wraps at 80 columns when piped; the table needs more to stay one line per row.
    console = Console() if sys.stdout.isatty() else Console(width=150)
    hf_logging.disable_progress_bar()

    gbps = copy_gbps()
    meta = {
        "torch": torch.__version__,
        "machine": platform.machine(),
        "processor": platform.processor(),
        "threads": args.threads,
        "dtype": args.dtype,
        "seed": args.seed,
        "quick": args.quick,
        "hf_static_batch": HF_BATCH,
        "copy_gbps": gbps,
        "copy_gbps_note": "best of 7 copies of 512 MiB, bytes read + bytes written",
        "loadavg_start": os.getloadavg(),
    }
    cores, load = os.cpu_count() or 1, meta["loadavg_start"][0]
    if load > cores - args.threads + 0.5:
        # Oversubscribed OpenMP threads stall at every barrier: multi-threaded timings can
        # come out several times slower, and not equally so for both sides.
        console.print(
            f"[yellow]the machine is busy (load {load:.1f} on {cores} cores, {args.threads} "
            "threads here): timings include other processes' interference[/yellow]"
        )
    start = time.perf_counter()
    results = [bench_model(spec, args, gbps, console) for spec in args.model or ["tiny", "default"]]
    meta |= {"loadavg_end": os.getloadavg(), "total_s": time.perf_counter() - start}
    all_rows = [row for r in results for row in rows(r)]
    print_table(console, all_rows, meta)
    print_notes(console, results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"meta": meta, "results": results, "table": all_rows}, indent=2) + "\n"
    )
    console.print(f"wrote {args.out} in {meta['total_s']:.0f} s")


if __name__ == "__main__":
    main()
