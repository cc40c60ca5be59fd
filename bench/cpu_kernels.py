"""The compiled CPU kernels of a decoder layer against what they replace (not a test).

* ``skinny_gemm``: every projection of a SmolLM2-135M decode step (30 layers of q|k|v, o,
  gate|up and down weights, float32), against oneDNN's packed matmul
  (the engine's path otherwise) at 1, 2, 4 and 8 rows. Reports ms per step and the ratio.
* ``decoder_pointwise``: a layer's pointwise work (residual add + RMSNorm, the q/k rotation,
  ``silu(gate) * up``) at 1 and 384 tokens, against the torch ops, float32 and bfloat16.

Runs alternate the two sides ``--reps`` times and report medians (the host's memory bandwidth
drifts by tens of percent within minutes). Writes bench/results/cpu_kernels.json.

    .venv/bin/python bench/cpu_kernels.py [--threads 2] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from edgeinfer.daemon.engine.linear import linear, pack
from edgeinfer.daemon.engine.rope import Rotation
from edgeinfer.kernels import decoder_pointwise, skinny_gemm

RESULTS = Path(__file__).parent / "results" / "cpu_kernels.json"
LAYERS = 30
# SmolLM2-135M: hidden 576, 9 + 3 + 3 heads of 64, intermediate 1536; (out, in) per weight.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def best_ms(fn: Callable[[], object], inner: int) -> float:
    """Fastest of three timings of ``inner`` calls, per call, in ms (after a warm-up call)."""
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - start) / inner)
    return min(times) * 1e3


def alternate(a: Callable[[], float], b: Callable[[], float], reps: int) -> tuple[float, float]:
    """Medians of ``reps`` alternating measurements of each side."""
    xs, ys = [], []
    for _ in range(reps):
        xs.append(a())
        ys.append(b())
    return statistics.median(xs), statistics.median(ys)


def projections(reps: int) -> list[dict]:
    weights = {s: [torch.randn(*s) * 0.05 for _ in range(LAYERS)] for s in SHAPES}
    packed = {s: [pack(w) for w in ws] for s, ws in weights.items()}
    panels = {s: [skinny_gemm.prepare(w) for w in ws] for s, ws in weights.items()}
    step_bytes = sum(w.numel() * 4 for ws in weights.values() for w in ws)
    rows_out = []
    for rows in (1, 2, 4, 8):  # decode steps of 1 to 8 sequences
        xs = {k: torch.randn(rows, k) for k in {s[1] for s in SHAPES}}

        def onednn(xs: dict[int, torch.Tensor] = xs) -> None:
            for s, ws in packed.items():
                for w in ws:
                    linear(xs[s[1]], w)

        def skinny(xs: dict[int, torch.Tensor] = xs) -> None:
            for s, ps in panels.items():
                for p in ps:
                    if p is not None:
                        skinny_gemm.skinny_linear(xs[s[1]], p)

        base, mine = alternate(lambda: best_ms(onednn, 3), lambda: best_ms(skinny, 3), reps)
        rows_out.append(
            {
                "kernel": "skinny_gemm",
                "case": f"{rows} row(s), float32, 120 projections",
                "baseline": "oneDNN packed",
                "baseline_ms": base,
                "kernel_ms": mine,
                "kernel_gb_s": step_bytes / mine / 1e6,
                "baseline_gb_s": step_bytes / base / 1e6,
                "ratio": base / mine,
            }
        )
    return rows_out


def pointwise_case(dtype: torch.dtype, tokens: int, reps: int) -> dict:
    x, attn = torch.randn(tokens, 576).to(dtype), torch.randn(tokens, 576).to(dtype)
    gate_up, qkv = torch.randn(tokens, 3072).to(dtype), torch.randn(tokens, 15, 64).to(dtype)
    rot = Rotation.build(torch.randn(tokens, 64), torch.randn(tokens, 64), dtype)
    weight = torch.ones(576, dtype=dtype)

    def torch_ops() -> None:
        total = x + attn
        weight * F.rms_norm(total.float(), (576,), None, 1e-5).to(dtype)
        rot.apply(qkv[:, :12])
        gate, up = gate_up.chunk(2, dim=-1)
        F.silu(gate).mul_(up)

    def compiled() -> None:
        decoder_pointwise.add_rms_norm(x, attn, weight, 1e-5)
        decoder_pointwise.rotate_(qkv[:, :12], rot.cos, rot.signed_sin)
        decoder_pointwise.silu_mul(gate_up)

    inner = 200 if tokens == 1 else 20
    base, mine = alternate(
        lambda: best_ms(torch_ops, inner), lambda: best_ms(compiled, inner), reps
    )
    return {
        "kernel": "decoder_pointwise",
        "case": f"{tokens} token(s), {str(dtype).removeprefix('torch.')}, one layer",
        "baseline": "torch ops",
        "baseline_ms": base,
        "kernel_ms": mine,
        "ratio": base / mine,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if not (skinny_gemm.available() and decoder_pointwise.available()):
        raise SystemExit("the compiled kernels are not available here (compiler or switch)")
    torch.set_num_threads(args.threads)
    with torch.inference_mode():
        rows = projections(args.reps) + [
            pointwise_case(dtype, tokens, args.reps)
            for dtype in (torch.float32, torch.bfloat16)
            for tokens in (1, 384)
        ]
    table = Table(title=f"compiled CPU kernels vs their baselines ({args.threads} threads)")
    for col in ("kernel", "case", "baseline", "baseline ms", "kernel ms", "ratio"):
        table.add_column(col, justify="right" if col.endswith(("ms", "ratio")) else "left")
    for r in rows:
        table.add_row(
            r["kernel"], r["case"], r["baseline"], f"{r['baseline_ms']:.3f}",
            f"{r['kernel_ms']:.3f}", f"{r['ratio']:.2f}x",
        )  # fmt: skip
    console = Console(width=120)
    console.print(table)
    console.print("ratio = baseline time / kernel time (> 1: the kernel is faster)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"threads": args.threads, "reps": args.reps, "rows": rows}, indent=2)
    )
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
