"""Measure the real engine for the simulator's cost model (not a test).

Runs :class:`LLMEngine` on the built-in SmolLM2-135M on the CPU, one thread, and measures

* prefill: wall time to the first token of ``b`` prompts of ``L`` tokens (chunked at the
  engine's ``max_num_batched_tokens``), for a grid of ``b`` and ``L``;
* decode: median time of a pure decode step for ``B`` sequences holding ``C`` tokens of context.

Then fits the linear step-cost model the simulator uses (``edgeinfer.sim.profile``):

    prefill step = fixed + per_token * tokens + attention * sum(tokens x context)
    decode step  = fixed + per_seq * batch + per_context_token * context tokens in the batch

and writes raw points, fit and residuals to ``router/edgeinfer/sim/data/engine_profile.json``.
A CPU running a 135M model is not a GPU serving an 8B model: on one core decode is
compute-bound (a step grows ~linearly with the batch), on a GPU it is bound by reading the
weights once per step, so batching is almost free. The measured coefficients therefore do not
transfer by one factor. The file also holds a ``gpu_like`` profile with the *same cost model*
and each coefficient from the roofline of Llama-3-8B bf16 on an H100-class GPU (constants below,
derivation in docs/SIMULATION.md); ``scale`` records each coefficient's factor over the measured
one. The simulator uses ``gpu_like`` unless told ``--profile measured``.

    .venv/bin/python bench/profile_engine.py [--quick | --refit]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edgeinfer.daemon.engine.config import EngineConfig
from edgeinfer.daemon.engine.llm_engine import LLMEngine
from edgeinfer.daemon.engine.sampling_params import SamplingParams

OUT = Path(__file__).parents[1] / "router/edgeinfer/sim/data/engine_profile.json"
# Llama-3-8B bf16 on an H100 SXM: 8e9 parameters, 32 layers, hidden 4096, 3.35 TB/s HBM,
# ~990 dense bf16 TFLOP/s of which serving engines reach ~40% in prefill, ~70% of HBM in decode.
PARAMS, LAYERS, HIDDEN = 8.0e9, 32, 4096
HBM_BYTES_S, PEAK_FLOPS = 3.35e12 * 0.7, 990e12 * 0.4
GPU_KV_BYTES_PER_TOKEN = 131_072  # as PlacementConfig: 32 layers x 8 heads x 128 x K,V x bf16
GPU_LIKE = {
    "prefill": {
        "fixed_s": 0.004,  # launches, scheduling, sampling: one per step
        "token_s": 2 * PARAMS / PEAK_FLOPS,  # ~16k prompt tokens/s
        "attention_s": 4 * LAYERS * HIDDEN / PEAK_FLOPS,  # QK^T and AV per token x position
    },
    "decode": {
        "fixed_s": 2 * PARAMS / HBM_BYTES_S,  # every weight read once per step (~7 ms)
        "seq_s": 2 * PARAMS / PEAK_FLOPS + 5e-5,  # its matmul share plus per-sequence overhead
        "context_token_s": GPU_KV_BYTES_PER_TOKEN / HBM_BYTES_S,  # its KV read once per step
    },
}
CHUNK = 2048


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def measure_prefill(engine: LLMEngine, grid: list[tuple[int, int]], reps: int) -> list[dict]:
    rng, vocab = random.Random(0), engine.model_config.vocab_size
    points = []
    for length, batch in grid:
        best = float("inf")
        for _ in range(reps):
            prompts = [_prompt(rng, length, vocab) for _ in range(batch)]
            start = time.perf_counter()
            engine.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
            best = min(best, time.perf_counter() - start)
        steps = -(-length * batch // CHUNK)
        points.append({"length": length, "batch": batch, "steps": steps, "seconds": best})
        print(f"prefill L={length:5} b={batch}: {best * 1000:8.1f} ms")
    return points


def measure_decode(engine: LLMEngine, grid: list[tuple[int, int]], steps: int) -> list[dict]:
    rng, vocab = random.Random(1), engine.model_config.vocab_size
    points = []
    for batch, context in grid:
        params = SamplingParams(max_tokens=steps + 4, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"d{batch}-{context}-{i}", _prompt(rng, context, vocab), params)
        started: set[str] = set()
        while len(started) < batch:  # prefill everything first: only pure decode steps count
            started.update(o.request_id for o in engine.step() if o.new_token_ids)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        while engine.has_unfinished_requests():
            engine.step()
        step_s = statistics.median(times)
        points.append({"batch": batch, "context": context, "step_s": step_s})
        print(f"decode B={batch:3} C={context:5}: {step_s * 1000:8.2f} ms/step")
    return points


def fit(rows: list[list[float]], y: list[float], names: list[str]) -> dict[str, float]:
    """Least squares with every coefficient >= 0: a negative cost is noise, so its regressor is
    dropped and the rest refitted."""
    keep = list(range(len(names)))
    x, target = np.asarray(rows, dtype=np.float64), np.asarray(y, dtype=np.float64)
    while True:
        coef = np.linalg.lstsq(x[:, keep], target, rcond=None)[0]
        if (coef >= 0).all():
            break
        keep.pop(int(np.argmin(coef)))
    out = dict.fromkeys(names, 0.0)
    out.update({names[k]: float(c) for k, c in zip(keep, coef)})
    return out


def measure(quick: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    engine = LLMEngine(
        EngineConfig(num_threads=1, kv_cache_bytes=2 << 30, enable_prefix_caching=False,
                     max_num_seqs=64, max_num_batched_tokens=CHUNK)
    )  # fmt: skip
    # A 135M model on one core computes ~150 prompt tokens/s: the grid is sized for minutes.
    lengths = [32, 256, 1024] if quick else [32, 128, 512, 1024, 2048, 4096]
    p_grid = [(n, 1) for n in lengths] + [(n, 4) for n in lengths if n <= 512]
    d_grid = [(b, 64) for b in ([1, 8] if quick else [1, 4, 16, 32])]
    d_grid += [(b, 1024) for b in ([1, 4] if quick else [1, 8])]
    cfg = engine.model_config
    return {
        "prefill_points": measure_prefill(engine, p_grid, reps=1),
        "decode_points": measure_decode(engine, d_grid, steps=4 if quick else 8),
        "kv_bytes_per_token": 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4,  # fp32
        "max_num_batched_tokens": CHUNK,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller grid (smoke run)")
    parser.add_argument("--refit", action="store_true", help="refit the points already in --out")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    measured = json.loads(args.out.read_text())["measured"] if args.refit else measure(args.quick)
    prefill, decode = measured["prefill_points"], measured["decode_points"]
    # Attention of a prompt chunked at CHUNK: each token attends to the tokens before it.
    p_rows = [[p["steps"], p["length"] * p["batch"], p["batch"] * p["length"] ** 2 / 2]
              for p in prefill]  # fmt: skip
    p_fit = fit(p_rows, [p["seconds"] for p in prefill], ["fixed_s", "token_s", "attention_s"])
    d_rows = [[1.0, d["batch"], d["batch"] * d["context"]] for d in decode]
    d_fit = fit(d_rows, [d["step_s"] for d in decode], ["fixed_s", "seq_s", "context_token_s"])
    residual = {
        "prefill": [y - sum(c * x for c, x in zip(p_fit.values(), row))
                    for row, y in zip(p_rows, (p["seconds"] for p in prefill))],
        "decode": [y - sum(c * x for c, x in zip(d_fit.values(), row))
                   for row, y in zip(d_rows, (d["step_s"] for d in decode))],
    }  # fmt: skip
    scale = {f"{stage}.{k}": (v / fitted[k] if fitted[k] > 0 else None)
             for stage, fitted in (("prefill", p_fit), ("decode", d_fit))
             for k, v in GPU_LIKE[stage].items()}  # fmt: skip
    result: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct",
        "host": {"machine": platform.machine(), "torch_threads": 1, "dtype": "float32"},
        "measured": measured | {"prefill": p_fit, "decode": d_fit, "residual_s": residual},
        "gpu_like": {
            "why": "roofline of Llama-3-8B bf16 on an H100-class GPU in the measured cost model "
            "(bench/profile_engine.py, docs/SIMULATION.md); scale = gpu_like / measured",
            "scale": scale,
            **GPU_LIKE,
            "kv_bytes_per_token": GPU_KV_BYTES_PER_TOKEN,
            "max_num_batched_tokens": CHUNK,
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"prefill": p_fit, "decode": d_fit, "scale": scale}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
