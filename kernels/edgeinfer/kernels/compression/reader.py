"""Read compressed safetensors checkpoints: the API the engine's weight loader calls.

A compressed file is an ordinary safetensors file: each bf16/fp16 tensor ``name`` is stored as
the uint8/int32 parts ``name::ei.code``, ``::ei.offsets``, ``::ei.bits`` and ``::ei.raw`` (plus
``::ei.counts`` and ``::ei.index`` in palette mode), and the header metadata key
``edgeinfer.compression`` describes it (dtype, shape, chunk, CRC-32, mode); other tensors are
stored unchanged under their own names.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from safetensors import safe_open

from edgeinfer.kernels.compression.cpu_decoder import decode_many_cpu
from edgeinfer.kernels.compression.errors import CorruptDataError, UnsupportedFormatError
from edgeinfer.kernels.compression.format import (
    METADATA_KEY,
    PART_SEPARATOR,
    READABLE_VERSIONS,
    CompressedTensor,
    stored_parts,
)

# The CPU path decodes consecutive tensors of a file together, up to this many output bytes:
# the numpy fallback's lock-step loop over all their chunks amortises its per-call cost.
BATCH_BYTES = 64 << 20
_ITEM_SIZES = {
    "F64": 8,
    "I64": 8,
    "U64": 8,
    "F32": 4,
    "I32": 4,
    "U32": 4,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "U16": 2,
}
# Safetensors dtype code of each compressed dtype, so headers read the same for both kinds.
_DTYPE_CODES = {"bfloat16": "BF16", "float16": "F16"}


def open_safetensors(path: Path) -> tuple[Any, dict[str, str]]:
    """Open ``path`` with safetensors; returns (handle, header metadata). Caller closes handle."""
    try:
        handle = safe_open(str(path), framework="pt")
        metadata = handle.metadata() or {}
    except Exception as exc:  # safetensors raises its own error types
        raise CorruptDataError(f"{path}: not a readable safetensors file ({exc})") from exc
    return handle, metadata


def compression_entries(metadata: dict[str, str], path: Path) -> dict[str, dict[str, Any]] | None:
    """The per-tensor descriptions of a compressed file, or None for an ordinary file."""
    if METADATA_KEY not in metadata:
        return None
    try:
        header = json.loads(metadata[METADATA_KEY])
        version, entries = header["version"], header["tensors"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptDataError(f"{path}: malformed compression header ({exc})") from exc
    if version not in READABLE_VERSIONS:
        raise UnsupportedFormatError(
            f"{path}: compression format version {version} is not supported (this edgeinfer "
            f"reads versions {', '.join(map(str, READABLE_VERSIONS))}): upgrade edgeinfer, or "
            "recompress the original checkpoint with this one"
        )
    return dict(entries)


def is_compressed_checkpoint(path: str | Path) -> bool:
    """True when ``path`` (a directory or a .safetensors file) holds a compressed file."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    for file in files:
        handle, metadata = open_safetensors(file)
        with handle:
            if METADATA_KEY in metadata:
                return True
    return False


def decompress(tensor: CompressedTensor) -> torch.Tensor:
    """Decode on the device that holds the parts: Triton on CUDA, numba (or numpy) on the CPU."""
    if tensor.bits.is_cuda:
        from edgeinfer.kernels.compression.triton_decoder import decode_triton

        return decode_triton(tensor)
    return decode_many_cpu([tensor])[0]


class CompressedSafetensorsReader:
    """Tensors of a compressed (or plain) safetensors file or directory, bit-exact.

    ``get(name)`` returns the original tensor; ``get_compressed(name)`` returns the
    :class:`CompressedTensor` (or None for a tensor stored as is), which the engine can move to
    the GPU and ``decompress`` just before use, keeping weights compressed in GPU memory.
    Every compressed tensor is checksummed before decoding: damage raises
    :class:`CorruptDataError`, never yields garbage weights.
    """

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
        if not files:
            raise CorruptDataError(f"no .safetensors file in {path}")
        self._stack = ExitStack()
        self._metadata: dict[Path, dict[str, str]] = {}
        self._entries: dict[str, tuple[Any, Path, dict[str, Any] | None]] = {}
        for file in files:
            handle, metadata = open_safetensors(file)
            self._stack.enter_context(handle)
            self._metadata[file] = metadata
            entries: dict[str, dict[str, Any] | None] = {
                key: None
                for key in handle.keys()  # noqa: SIM118 - safetensors handles are not iterable
                if PART_SEPARATOR not in key
            }
            entries.update(compression_entries(metadata, file) or {})
            for name in sorted(entries):
                self._entries[name] = (handle, file, entries[name])
        self._cache: dict[str, torch.Tensor] = {}

    def names(self) -> list[str]:
        """Logical tensor names, grouped by file."""
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def _lookup(self, name: str) -> tuple[Any, Path, dict[str, Any] | None]:
        if name not in self._entries:
            raise KeyError(f"tensor {name} is not in this checkpoint")
        return self._entries[name]

    def metadata(self, file: Path) -> dict[str, str]:
        """Header metadata of one of the files read (includes the compression key if any)."""
        return self._metadata[file]

    def header_info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """Safetensors dtype code ("BF16", "F32"...) and shape of the original tensor.

        Read from the headers only, so a loader can check shapes before decoding anything.
        """
        handle, file, entry = self._lookup(name)
        if entry is None:
            view = handle.get_slice(name)
            return view.get_dtype(), tuple(view.get_shape())
        try:
            return _DTYPE_CODES[entry["dtype"]], tuple(int(d) for d in entry["shape"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptDataError(f"{file}: tensor {name}: malformed metadata ({exc})") from exc

    def stored_nbytes(self, name: str) -> int:
        """Bytes the tensor takes in the file (all its parts when compressed)."""
        handle, _, entry = self._lookup(name)
        keys = (
            [name] if entry is None else [f"{name}{PART_SEPARATOR}{p}" for p in stored_parts(entry)]
        )
        total = 0
        for key in keys:
            view = handle.get_slice(key)
            numel = 1
            for dim in view.get_shape():
                numel *= dim
            total += numel * _ITEM_SIZES.get(view.get_dtype(), 1)  # the rest are 1-byte types
        return total

    def get_compressed(self, name: str) -> CompressedTensor | None:
        handle, file, entry = self._lookup(name)
        if entry is None:
            return None
        try:
            parts = {
                p: handle.get_tensor(f"{name}{PART_SEPARATOR}{p}") for p in stored_parts(entry)
            }
        except Exception as exc:  # a missing part surfaces as a safetensors error
            raise CorruptDataError(f"{file}: tensor {name} has missing parts ({exc})") from exc
        return CompressedTensor.from_parts(entry, parts, f"{file}: tensor {name}")

    def get(self, name: str) -> torch.Tensor:
        """The original tensor on the CPU (decoded together with the tensors that follow it)."""
        if name in self._cache:
            return self._cache.pop(name)
        handle, _, entry = self._lookup(name)
        if entry is None:
            return handle.get_tensor(name)
        batch = self._batch_from(name)
        decoded = decode_many_cpu([t for _, t in batch])
        self._cache = {n: t for (n, _), t in zip(batch, decoded, strict=True)}
        return self._cache.pop(name)

    def _batch_from(self, name: str) -> list[tuple[str, CompressedTensor]]:
        """``name`` and the compressed tensors after it in the same file, up to BATCH_BYTES."""
        names = self.names()
        handle = self._entries[name][0]
        batch: list[tuple[str, CompressedTensor]] = []
        size = 0
        for other in names[names.index(name) :]:
            other_handle, _, entry = self._entries[other]
            if other_handle is not handle or size >= BATCH_BYTES:
                break
            if entry is not None:
                tensor = self.get_compressed(other)
                if tensor is not None:
                    batch.append((other, tensor))
                    size += 2 * tensor.numel
        return batch

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.names():
            yield name, self.get(name)

    def close(self) -> None:
        self._cache.clear()
        self._stack.close()

    def __enter__(self) -> CompressedSafetensorsReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
