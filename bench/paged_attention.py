"""Decode paged-attention benchmark (not a test).

Times the torch reference on CPU and, when CUDA is available, the Triton kernel against the
torch reference on the GPU. Prints a table and writes bench/results/paged_attention.json.

    .venv/bin/python bench/paged_attention.py [--iters N]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from edgeinfer.kernels.paged_attention import paged_decode_attention, paged_decode_attention_ref
from edgeinfer.kernels.triton_utils import triton_available

# (query heads, kv heads, head_dim): CPU uses the engine's default model (SmolLM2-135M), the GPU
# a Llama-3-8B-like layer where attention bandwidth matters.
CPU_GEOMETRY, GPU_GEOMETRY, PAGE = (9, 3, 64), (32, 8, 128), 16
CPU_CASES = [(1, 512), (8, 512), (8, 2048), (32, 1024)]  # (batch, context)
GPU_CASES = [(1, 512), (1, 32768), (8, 4096), (64, 2048), (256, 1024)]
RESULTS = Path(__file__).parent / "results" / "paged_attention.json"


def make_inputs(batch: int, context: int, dtype: torch.dtype, device: str) -> tuple:
    """Random cache with every sequence at `context` tokens on shuffled blocks."""
    heads, kv_heads, head_dim = GPU_GEOMETRY if device == "cuda" else CPU_GEOMETRY
    per_seq = math.ceil(context / PAGE)
    num_blocks = batch * per_seq
    shape = (num_blocks, PAGE, kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    tables = torch.randperm(num_blocks, device=device).view(batch, per_seq).int()
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, head_dim, dtype=dtype, device=device)
    return q, k_cache, v_cache, tables, lens, head_dim**-0.5


def time_ms(fn: Callable[[], object], iters: int, device: str) -> float:
    """Median wall time of `fn` in milliseconds after two warm-up calls (JIT compile, caches)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(2):
        fn()
    sync()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def kv_gbps(args: tuple, ms: float) -> float:
    """Effective K+V read bandwidth (live tokens only): what bounds any decode kernel."""
    k_cache, lens = args[1], args[4]
    kv_bytes = 2 * int(lens.sum()) * k_cache[0, 0].numel() * k_cache.element_size()
    return kv_bytes / (ms * 1e-3) / 1e9


def run_cpu(iters: int) -> list[dict]:
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for batch, context in CPU_CASES:
            args = make_inputs(batch, context, dtype, "cpu")
            ms = time_ms(lambda args=args: paged_decode_attention_ref(*args), iters, "cpu")
            rows.append(
                {"device": "cpu", "impl": "torch_ref", "dtype": str(dtype).removeprefix("torch.")}
                | {"batch": batch, "context": context, "ms": ms}
                | {"kv_gbps": kv_gbps(args, ms)}
            )
    return rows


def run_gpu(iters: int) -> list[dict]:
    rows = []
    for batch, context in GPU_CASES:
        args = make_inputs(batch, context, torch.bfloat16, "cuda")
        ref_ms = time_ms(lambda args=args: paged_decode_attention_ref(*args), iters, "cuda")
        tri_ms = time_ms(lambda args=args: paged_decode_attention(*args), iters, "cuda")
        torch.testing.assert_close(
            paged_decode_attention(*args), paged_decode_attention_ref(*args), atol=2e-2, rtol=2e-2
        )
        rows.append(
            {"device": "cuda", "dtype": "bfloat16", "batch": batch, "context": context}
            | {"ref_ms": ref_ms, "triton_ms": tri_ms, "speedup": ref_ms / tri_ms}
            | {"triton_kv_gbps": kv_gbps(args, tri_ms)}
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=10, help="timed calls per case")
    iters = parser.parse_args().iters
    torch.manual_seed(0)
    # The first pass over growing sizes is dominated by page faults while glibc ratchets up its
    # mmap/trim thresholds; a long-running engine sees the second, steady-state pass.
    run_cpu(1)
    cpu_rows = run_cpu(iters)
    print(f"CPU torch reference, (H, Hkv, D) = {CPU_GEOMETRY}, {torch.get_num_threads()} threads")
    print(f"{'dtype':>9} {'batch':>5} {'context':>7} {'ms':>9} {'KV GB/s':>8}")
    for r in cpu_rows:
        print(
            f"{r['dtype']:>9} {r['batch']:>5} {r['context']:>7} {r['ms']:>9.3f} {r['kv_gbps']:>8.2f}"
        )
    gpu_rows: list[dict] = []
    if torch.cuda.is_available() and triton_available():
        gpu_rows = run_gpu(iters)
        print(f"\nGPU bf16 {GPU_GEOMETRY} on {torch.cuda.get_device_name()}: Triton vs torch ref")
        print(
            f"{'batch':>5} {'context':>7} {'ref ms':>9} {'triton ms':>9} {'ratio':>6} {'GB/s':>7}"
        )
        for r in gpu_rows:
            print(
                f"{r['batch']:>5} {r['context']:>7} {r['ref_ms']:>9.3f} {r['triton_ms']:>9.3f} "
                f"{r['speedup']:>6.2f} {r['triton_kv_gbps']:>7.0f}"
            )
    else:
        print("\nno CUDA device (or no triton): GPU comparison skipped")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "machine": platform.machine(), "iters": iters}
    geometry = {"cpu_geometry": CPU_GEOMETRY, "gpu_geometry": GPU_GEOMETRY, "page": PAGE}
    payload = {"meta": meta | geometry, "cpu": cpu_rows, "gpu": gpu_rows}
    RESULTS.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
