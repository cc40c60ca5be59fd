"""The bf16 skinny GEMM's tile width on this host (not a test): one panel per tile (the build the
engine loads) against tiles of up to 8 panels (a variant built with
``-DEDGEINFER_BF16_TILE_PANELS=8``), side by side in one process.

Both libraries read the same panels (the tile width does not change the layout), over
SmolLM2-135M's whole decode step: 30 layers of the fused projections (qkv 960x576, o 576x576,
gate_up 3072x576, down 576x1536) and the 49152x576 LM head, 269 MB of bf16 weights, more than any
cache holds. Steps of the two builds alternate; per row count the medians, the GB/s they read,
and the ratio (> 1: one panel is faster). Outputs must be equal (same sums in the same order).

    .venv/bin/python bench/skinny_tiles.py [--rows 1,2,4,8] [--steps 60] [--threads 2]

Needs a build with AVX512-BF16 (``skinny_gemm.takes_bf16()``); writes
``bench/results/skinny_tiles.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from cpu_kernels import host_flags
from edgeinfer.kernels import native_build, skinny_gemm

RESULTS = Path(__file__).parent / "results" / "skinny_tiles.json"
LAYERS = 30
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in) per layer
LM_HEAD = (49152, 576)
VARIANTS = {"one panel": (), "up to 8 panels": ("EDGEINFER_BF16_TILE_PANELS=8",)}


def gemm_of(defines: tuple[str, ...]) -> ctypes._CFuncPtr:
    """The bf16 entry point of a build with ``defines``, typed as the engine's wrapper types it."""
    lib = ctypes.CDLL(str(native_build.build("skinny_gemm", defines=defines)))
    return skinny_gemm._Kernel(lib).gemm[torch.bfloat16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if not skinny_gemm.takes_bf16():
        raise SystemExit("this host's build has no bf16 skinny GEMM (no AVX512-BF16)")
    torch.manual_seed(0)
    shapes = [s for _ in range(LAYERS) for s in SHAPES] + [LM_HEAD]
    weights = [skinny_gemm.prepare(torch.randn(*s).to(torch.bfloat16)) for s in shapes]
    if any(w is None for w in weights):
        raise SystemExit("skinny_gemm.prepare refused a weight")
    nbytes = sum(o * i * 2 for o, i in shapes)
    gemms = {name: gemm_of(defines) for name, defines in VARIANTS.items()}
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {i: torch.randn(rows, i).to(torch.bfloat16) for i in {i for _, i in shapes}}
        ys = {name: [torch.empty(rows, o, dtype=torch.bfloat16) for o, _ in shapes]
              for name in gemms}  # fmt: skip
        calls = {
            name: [
                (xs[w.in_features].data_ptr(), w.in_features, w.panels.data_ptr(), None, rows,
                 w.in_features, w.out_features, y.data_ptr(), args.threads)
                for w, y in zip(weights, ys[name], strict=True)
            ]
            for name in gemms
        }  # fmt: skip
        times: dict[str, list[float]] = {name: [] for name in gemms}
        for step in range(args.steps + 3):
            for name, gemm in gemms.items():
                start = time.perf_counter()
                for call in calls[name]:
                    gemm(*call)
                if step >= 3:  # warm-up steps are not kept
                    times[name].append(time.perf_counter() - start)
        first, other = ys.values()
        if not all(torch.equal(a, b) for a, b in zip(first, other, strict=True)):
            raise SystemExit(f"the two builds disagree at {rows} rows")
        med = {name: statistics.median(t) for name, t in times.items()}
        one, many = med["one panel"], med["up to 8 panels"]
        results.append({
            "rows": rows, "ms": {n: round(m * 1e3, 3) for n, m in med.items()},
            "gb_s": {n: round(nbytes / m / 1e9, 1) for n, m in med.items()},
            "one_panel_speedup": round(many / one, 3),
        })  # fmt: skip
        print(f"{rows} rows: one panel {one * 1e3:.2f} ms ({nbytes / one / 1e9:.1f} GB/s), "
              f"up to 8 panels {many * 1e3:.2f} ms ({nbytes / many / 1e9:.1f} GB/s): "
              f"{many / one:.2f}x")  # fmt: skip
    out = {
        "host": {"machine": platform.machine(), "cpu_flags": host_flags(),
                 "threads": args.threads},
        "weight_mb": round(nbytes / 1e6), "steps": args.steps, "results": results,
    }  # fmt: skip
    print(f"host flags: {out['host']['cpu_flags']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
