"""Compress and decompress whole checkpoint directories of safetensors files.

Works on any directory: every ``*.safetensors`` file (at any depth) is rewritten under the same
relative path with each bf16/fp16 tensor compressed and every other tensor stored as is; all other
files are copied unchanged, so index files and tokenizers keep working.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from edgeinfer.kernels.compression.encoder import (
    compress_tensor,
    exponent_entropy_bits,
    split_words,
)
from edgeinfer.kernels.compression.errors import CompressionError
from edgeinfer.kernels.compression.format import (
    DEFAULT_CHUNK,
    DTYPES,
    FORMAT_VERSION,
    METADATA_KEY,
    PART_SEPARATOR,
)
from edgeinfer.kernels.compression.reader import (
    CompressedSafetensorsReader,
    compression_entries,
    open_safetensors,
)

# Called after each tensor with (tensor name, bytes of the original tensor).
Progress = Callable[[str, int], None]

# First matching rule wins: "attention.output.LayerNorm" is a norm, "attention.output.dense" is
# attention, BERT's "layer.N.output.dense" falls through to mlp.
_CLASS_RULES = (
    ("norm", ("norm", "ln_", ".ln", "ln1", "ln2")),
    ("embedding", ("embed", "wte", "wpe", "lm_head", "token_type")),
    ("attention", ("attn", "attention", "q_proj", "k_proj", "v_proj", "o_proj", "qkv")),
    ("mlp", ("mlp", "ffn", "feed_forward", "proj", "intermediate", "output.dense", "fc")),
)


def tensor_class(name: str) -> str:
    """Coarse class of a tensor, from its name: attention, mlp, embedding, norm or other."""
    lowered = name.lower()
    for label, needles in _CLASS_RULES:
        if any(needle in lowered for needle in needles):
            return label
    return "other"


@dataclass(frozen=True)
class TensorReport:
    """Sizes of one tensor before and after compression, and the exponent entropy bound."""

    file: str
    name: str
    dtype: str
    bytes_before: int
    bytes_after: int
    bound_bytes: float

    @property
    def tensor_class(self) -> str:
        return tensor_class(self.name)


def safetensors_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.safetensors") if p.is_file())


def _copy_other_files(in_dir: Path, out_dir: Path) -> None:
    for src in sorted(in_dir.rglob("*")):
        if src.is_file() and src.suffix != ".safetensors":
            dst = out_dir / src.relative_to(in_dir)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)


def compress_dir(
    in_dir: str | Path,
    out_dir: str | Path,
    progress: Progress | None = None,
    chunk: int = DEFAULT_CHUNK,
) -> list[TensorReport]:
    """Write a compressed copy of ``in_dir`` to ``out_dir``; returns one report per tensor."""
    in_dir, out_dir = Path(in_dir), Path(out_dir)
    if not in_dir.is_dir():
        raise CompressionError(f"{in_dir} is not a directory")
    reports: list[TensorReport] = []
    for src in safetensors_files(in_dir):
        rel = src.relative_to(in_dir)
        handle, metadata = open_safetensors(src)
        if compression_entries(metadata, src) is not None:
            raise CompressionError(f"{src} is already compressed")
        stored: dict[str, torch.Tensor] = {}
        entries: dict[str, dict[str, object]] = {}
        with handle:
            for name in handle.keys():  # noqa: SIM118 - safetensors handles are not iterable
                if PART_SEPARATOR in name:
                    raise CompressionError(f"{src}: tensor name {name!r} uses a reserved suffix")
                tensor = handle.get_tensor(name)
                before = tensor.numel() * tensor.element_size()
                if tensor.dtype not in DTYPES.values():
                    stored[name] = tensor
                    reports.append(
                        TensorReport(str(rel), name, str(tensor.dtype), before, before, before)
                    )
                else:
                    packed = compress_tensor(tensor, chunk)
                    entries[name] = packed.describe()
                    stored.update(
                        {f"{name}{PART_SEPARATOR}{p}": v for p, v in packed.parts().items()}
                    )
                    reports.append(
                        TensorReport(
                            str(rel), name, packed.dtype, before, packed.nbytes, _bound(tensor)
                        )
                    )
                if progress is not None:
                    progress(name, before)
        header = {METADATA_KEY: json.dumps({"version": FORMAT_VERSION, "tensors": entries})}
        (out_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        save_file(stored, str(out_dir / rel), metadata={**metadata, **header})
    _copy_other_files(in_dir, out_dir)
    return reports


def _bound(tensor: torch.Tensor) -> float:
    """Entropy bound in bytes: coded byte at its Shannon entropy, raw byte as is."""
    words = tensor.contiguous().view(torch.int16).numpy().view(np.uint16).ravel()
    coded, _ = split_words(words, next(k for k, v in DTYPES.items() if v == tensor.dtype))
    return tensor.numel() * (exponent_entropy_bits(coded) + 8) / 8


def decompress_dir(
    in_dir: str | Path, out_dir: str | Path, progress: Progress | None = None
) -> list[TensorReport]:
    """Write the original checkpoint back from a compressed one, every tensor bit for bit.

    Reports give the stored (compressed) size as ``bytes_after`` and the restored size as
    ``bytes_before``, the same orientation as :func:`compress_dir`.
    """
    in_dir, out_dir = Path(in_dir), Path(out_dir)
    if not in_dir.is_dir():
        raise CompressionError(f"{in_dir} is not a directory")
    reports: list[TensorReport] = []
    for src in safetensors_files(in_dir):
        rel = src.relative_to(in_dir)
        restored: dict[str, torch.Tensor] = {}
        with CompressedSafetensorsReader(src) as reader:
            for name in reader.names():
                tensor = reader.get(name)
                restored[name] = tensor
                before = tensor.numel() * tensor.element_size()
                after = reader.stored_nbytes(name)
                reports.append(
                    TensorReport(str(rel), name, str(tensor.dtype), before, after, after)
                )
                if progress is not None:
                    progress(name, before)
            metadata = {k: v for k, v in reader.metadata(src).items() if k != METADATA_KEY}
        (out_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        save_file(restored, str(out_dir / rel), metadata=metadata or None)
    _copy_other_files(in_dir, out_dir)
    return reports
