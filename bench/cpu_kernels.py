"""The compiled CPU kernels against the library calls they replace, as the engine chooses them
(not a test).

Builds SmolLM2-135M (random weights, float32 by default) as the engine does, runs the engine's
kernel trials on it (``kernel_trials.trial_sets``: ``skinny_gemm`` per projection shape at 1-8
rows against oneDNN, each ``decoder_pointwise`` op against the torch ops, the decode and prefill
attention kernels against the portable path) and reports, per case, what the engine chose
(its own short timing, fresh, no cache) beside a longer measurement here. The target: every
case the engine chose is >= 1.1x its baseline here; where it kept the baseline, the baseline
runs. Then the fused decode path (``kernel_trials.fused_trials``: the 30 layers in one compiled
call against op by op, as routed) at 1/2/4/8 rows; last, a whole decode step's projections at
1/2/4/8 rows as the engine routes them, against oneDNN only.

``--march x86-64-v3`` builds the kernels for AVX2 (a stand-in for AVX2 hosts on an AVX-512
one). Both sides of a case alternate in rounds; each round keeps a block's fastest call and the
ratio is the median over rounds (see ``kernel_choice.measure``). Writes
bench/results/cpu_kernels[-<march>][-<dtype>].json.

    .venv/bin/python bench/cpu_kernels.py [--threads 2] [--march native] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from edgeinfer.daemon.engine.attention_backend import attention_backend
from edgeinfer.daemon.engine.fused_decode import FusedDecode
from edgeinfer.daemon.engine.kernel_trials import fused_trials, projections, trial_sets
from edgeinfer.daemon.engine.kv_cache import KVCache, KVLayout
from edgeinfer.daemon.engine.linear import linear
from edgeinfer.daemon.engine.model import CausalLM
from edgeinfer.daemon.engine.model_config import ModelConfig
from edgeinfer.daemon.engine.trial_set import Sizes
from edgeinfer.kernels import kernel_choice, native_build
from edgeinfer.kernels.kernel_choice import Chooser, SizeRoute, Trial, measure

RESULTS = Path(__file__).parent / "results"
SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000,
    "tie_word_embeddings": True,
}


def build_model(dtype: torch.dtype, bf16_values: bool = True) -> CausalLM:
    """SmolLM2-135M with random weights, fused and packed as ``ModelRunner`` loads it; with
    ``bf16_values`` every weight is a bfloat16 value, as when its bf16 checkpoint is loaded
    (in float32 the skinny GEMM's panels are then held in bf16)."""
    cfg = ModelConfig.from_dict(SMOLLM2)
    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to_empty(device="cpu").to(dtype)
    model.lm_head.weight = model.model.embed_tokens.weight
    model.fuse_projections()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
            if bf16_values:
                p.copy_(p.bfloat16())
    model.pack_weights()
    return model


def host_flags() -> str:
    out = subprocess.run(
        ["grep", "-o", "-w", r"avx512f\|avx512_bf16\|amx_tile\|avx2", "/proc/cpuinfo"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return " ".join(sorted(set(out.split())))


def step_rows(model: CausalLM, budget_s: float) -> list[dict]:
    """A decode step's projections (every packed weight) as routed, against oneDNN only."""
    pairs = [pair for group in projections(model).values() for pair in group]
    rows_out: list[dict] = []
    for rows in (1, 2, 4, 8) if pairs else ():  # none where no weight has panels
        dtype = pairs[0][1].dtype
        xs = {w.in_features: torch.randn(rows, w.in_features).to(dtype) for _, w in pairs}

        def onednn(xs: dict = xs) -> None:
            for packed, skinny in pairs:
                linear(xs[skinny.in_features], packed)

        def routed(xs: dict = xs) -> None:
            for packed, skinny in pairs:
                linear(xs[skinny.in_features], packed, None, skinny)

        t = measure(onednn, routed, budget_s=budget_s, min_rounds=5)
        case = f"{len(pairs)} projections, {rows} rows, as routed"
        rows_out.append(
            {"kernel": "decode step", "case": case, "baseline": "oneDNN only"}
            | {"engine_ratio": None, "chosen": None, "bench": asdict(t)}
        )
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--march", default="native", choices=native_build.MARCHES)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--budget", type=float, default=0.4, help="seconds per case, here")
    parser.add_argument(
        "--any-float32-weights",
        action="store_true",
        help="random float32 weights that are not bfloat16 values (a float32 checkpoint): "
        "the skinny GEMM's panels stay float32",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    os.environ[native_build.ENV_MARCH] = args.march  # read when each library first loads
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    model = build_model(dtype, bf16_values=not args.any_float32_weights)
    cfg = model.config
    sizes = Sizes(dtype, block_size=16, max_num_seqs=64, max_tokens=2048)
    sets = trial_sets(model, sizes)
    if not sets:
        raise SystemExit("the compiled kernels are not available here (compiler or switch)")
    results = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        engine = Chooser(args.threads, path=Path(tmp) / "choice.json")  # fresh: no cache

        def check(trial: Trial) -> bool:
            """The engine's verdict on ``trial`` beside a longer measurement here (a row)."""
            verdict = engine.decide(trial)
            t = measure(*trial.setup(), budget_s=args.budget)
            results.append(
                {"kernel": trial.kernel, "case": trial.case, "baseline": trial.baseline}
                | {"engine_ratio": verdict.timing.ratio, "chosen": verdict.chosen}
                | {"bench": asdict(t)}
            )
            return verdict.chosen

        for s in sets:
            s.apply(SizeRoute({size: check(trial) for size, trial, _ in s.trials}))
        # The fused decode path against the layers op by op, as routed above.
        layout = KVLayout(cfg.num_layers, sizes.block_size, cfg.num_kv_heads, cfg.head_dim, dtype)
        kv_cache = KVCache(layout, 256, torch.device("cpu"))
        model.use_attention(attention_backend(torch.device("cpu"), layout))
        fused = FusedDecode.of(list(model.model.layers), kv_cache)
        for _, trial in [] if fused is None else fused_trials(model, fused, kv_cache, sizes):
            check(trial)
        results += step_rows(model, args.budget)
    flags = host_flags()
    title = f"compiled CPU kernels, -march={args.march}, {args.dtype}, {args.threads} threads"
    table = Table(title=f"{title} (host: {flags})")
    for col in ("kernel", "case", "baseline", "engine", "baseline us", "kernel us", "here"):
        table.add_column(col, justify="left" if col in ("kernel", "case", "baseline") else "right")
    for r in results:
        b = r["bench"]
        engine_col = "" if r["chosen"] is None else f"{r['engine_ratio']:.2f}x "
        engine_col += {True: "kernel", False: "baseline", None: ""}[r["chosen"]]
        flag = " !" if r["chosen"] and b["ratio"] < kernel_choice.MARGIN else ""
        table.add_row(
            r["kernel"], r["case"], r["baseline"], engine_col, f"{b['baseline_us']:.1f}",
            f"{b['kernel_us']:.1f}", f"{b['ratio']:.2f}x{flag}",
        )  # fmt: skip
    console = Console(width=150)
    console.print(table)
    console.print(
        "ratio = baseline time / kernel time (> 1: the kernel is faster); engine: its verdict "
        f"at load (kernel where >= {kernel_choice.MARGIN}x); '!': chosen but < "
        f"{kernel_choice.MARGIN}x here. {time.perf_counter() - start:.0f} s."
    )
    suffix = ("" if args.march == "native" else f"-{args.march}") + (
        "" if args.dtype == "float32" else f"-{args.dtype}"
    )
    out = args.out or RESULTS / f"cpu_kernels{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    body = {"threads": args.threads, "march": args.march, "dtype": args.dtype, "host": flags}
    out.write_text(json.dumps(body | {"rows": results}, indent=2))
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
