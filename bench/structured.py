"""Structured-output benchmark: constrained decoding against the same load unconstrained.

* throughput: 8 streams decoding at once with a 50-property JSON-schema constraint, and the
  same 8 streams without it (both ``ignore_eos``, same prompts and ``max_tokens``); output
  tokens per second of each over ``--reps`` interleaved runs (constrained, unconstrained,
  constrained, ...), since a shared host drifts by tens of percent in minutes: the ratio of
  the medians, of the medians per CPU second, and of the fastest runs (on a busy host the
  same run varies 10x; the fastest is the least disturbed). Target: constrained >= 0.9x.
* compile: the 50-property schema compiled cold (a fresh compiler; the per-model tokenizer
  description is built first and reported on its own) and cached (the same spec again), plus
  a matcher's creation and the mask of a batch of 8 per decode step.

Prints a summary and writes ``bench/results/structured[-MODEL].json``.

    .venv/bin/python bench/structured.py [--model tiny|default|DIR] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from edgeinfer.daemon.engine.config import EngineConfig
from edgeinfer.daemon.engine.llm_engine import LLMEngine
from edgeinfer.daemon.engine.sampling_params import SamplingParams
from edgeinfer.daemon.engine.structured import (
    GrammarCompiler,
    StructuredSpec,
    apply_token_masks,
)

RESULTS = Path(__file__).parent / "results"
STREAMS = 8
TYPES = (
    {"type": "string", "maxLength": 12},
    {"type": "integer"},
    {"type": "number"},
    {"type": "boolean"},
)


def schema(n: int = 50) -> dict[str, Any]:
    props = {f"field_{i}": TYPES[i % len(TYPES)] for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}  # fmt: skip


def throughput(engine: LLMEngine, spec: StructuredSpec | None, max_tokens: int) -> dict[str, Any]:
    prompts = [
        engine.encode_chat([{"role": "user", "content": f"Fill in record {i} as JSON."}])
        for i in range(STREAMS)
    ]
    params = [
        SamplingParams(
            max_tokens=max_tokens, temperature=0.8, seed=i, ignore_eos=True, structured=spec
        )
        for i in range(STREAMS)
    ]
    start, cpu = time.perf_counter(), time.process_time()
    done = engine.generate(prompts, params)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(len(c.token_ids) for c in done)
    valid = None
    if spec is not None:
        valid = sum(_is_json(c.text) for c in done if c.finish_reason == "stop")
    return {"wall_s": wall, "cpu_s": cpu, "output_tokens": tokens, "tok_s": tokens / wall,
            "tok_per_cpu_s": tokens / cpu,
            "finished_by_grammar": sum(c.finish_reason == "stop" for c in done),
            "valid_json": valid}  # fmt: skip


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def compile_times(engine: LLMEngine, spec: StructuredSpec) -> dict[str, float]:
    fresh = GrammarCompiler.from_dir(
        engine.model_dir, engine.model_config.vocab_size, engine.eos_token_ids
    )
    t = time.perf_counter()
    fresh.tokenizer  # noqa: B018 - builds the per-model tokenizer description
    tokenizer_s = time.perf_counter() - t
    t = time.perf_counter()
    fresh.compile(spec)
    cold_s = time.perf_counter() - t
    cached = []
    for _ in range(100):
        t = time.perf_counter()
        fresh.compile(spec)
        cached.append(time.perf_counter() - t)
    t = time.perf_counter()
    matchers = [fresh.matcher(spec) for _ in range(STREAMS)]
    matcher_s = (time.perf_counter() - t) / STREAMS
    logits = torch.zeros(STREAMS, engine.model_config.vocab_size)
    masks = []
    for _ in range(50):
        t = time.perf_counter()
        apply_token_masks(logits, range(STREAMS), matchers)
        masks.append(time.perf_counter() - t)
    return {"tokenizer_info_s": tokenizer_s, "compile_cold_s": cold_s,
            "compile_cached_s": statistics.median(cached), "matcher_create_s": matcher_s,
            "mask_batch8_s": statistics.median(masks)}  # fmt: skip


def cpu_flags() -> list[str]:
    wanted = {"avx2", "avx512f", "avx512_bf16", "amx_tile"}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    return sorted(wanted.intersection(text.split()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help='"tiny", "default" or a directory')
    parser.add_argument("--reps", type=int, default=3, help="interleaved runs per side")
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(model=None if args.model == "default" else args.model))
    spec = StructuredSpec.json_schema(schema(), "response_format")
    compile_result = compile_times(engine, spec)
    engine.generate(["warm-up"], SamplingParams(max_tokens=8, structured=spec))
    runs: dict[str, list[dict[str, Any]]] = {"constrained": [], "unconstrained": []}
    for _ in range(args.reps):
        runs["constrained"].append(throughput(engine, spec, args.max_tokens))
        runs["unconstrained"].append(throughput(engine, None, args.max_tokens))
    median = {k: statistics.median(r["tok_s"] for r in v) for k, v in runs.items()}
    ratio = median["constrained"] / median["unconstrained"]
    # Tokens per second of process CPU time: what the constraint costs, less sensitive than
    # wall time to other tenants of a shared host.
    per_cpu = {k: statistics.median(r["tok_per_cpu_s"] for r in v) for k, v in runs.items()}
    cpu_ratio = per_cpu["constrained"] / per_cpu["unconstrained"]
    # The fastest run of each side: the one other tenants disturbed least.
    best = {k: max(r["tok_s"] for r in v) for k, v in runs.items()}
    best_ratio = best["constrained"] / best["unconstrained"]
    result = {
        "model": args.model,
        "streams": STREAMS,
        "max_tokens": args.max_tokens,
        "constrained_tok_s": median["constrained"],
        "unconstrained_tok_s": median["unconstrained"],
        "ratio": ratio,
        "cpu_ratio": cpu_ratio,
        "best_ratio": best_ratio,
        "target_ratio": 0.9,
        "compile": compile_result,
        "runs": runs,
        "host": {"cpu_flags": cpu_flags(), "cpus": os.cpu_count(),
                 "torch_threads": torch.get_num_threads(), "machine": platform.machine()},
    }  # fmt: skip
    name = "structured.json" if args.model == "tiny" else f"structured-{Path(args.model).name}.json"
    path = RESULTS / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    c = compile_result
    print(
        f"{STREAMS} streams, model {args.model}: constrained {median['constrained']:.1f} tok/s, "
        f"unconstrained {median['unconstrained']:.1f} tok/s, ratio {ratio:.3f} (target >= 0.9); "
        f"per CPU second: ratio {cpu_ratio:.3f}; fastest runs: ratio {best_ratio:.3f}"
    )
    print(f"50-property schema: compile cold {c['compile_cold_s'] * 1e3:.2f} ms, cached "
          f"{c['compile_cached_s'] * 1e6:.1f} us; tokenizer info {c['tokenizer_info_s']:.3f} s; "
          f"matcher {c['matcher_create_s'] * 1e6:.0f} us; mask of 8 rows "
          f"{c['mask_batch8_s'] * 1e3:.3f} ms")  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
