"""Streaming, memory-mapped access to safetensors checkpoints (single file or sharded).

Weights are read one tensor at a time straight from the memory-mapped files into the model's
existing parameters, so peak host memory stays near the size of the largest tensor rather than
the whole checkpoint.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from edgeinfer.daemon.engine.errors import ModelLoadError
from edgeinfer.kernels.compression.errors import CompressionError
from edgeinfer.kernels.compression.format import CompressedTensor
from edgeinfer.kernels.compression.reader import (
    CompressedSafetensorsReader,
    is_compressed_checkpoint,
)

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointReader:
    """Read-only view of the tensors of a Hugging Face safetensors checkpoint directory.

    Shards written by ``edgectl compress`` are detected per file and read through
    :class:`CompressedSafetensorsReader`: tensors come back bit-exact, and a damaged shard raises
    :class:`ModelLoadError` (naming file and tensor) instead of yielding garbage weights.
    """

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self._stack = ExitStack()
        # A safetensors handle for a plain shard, a CompressedSafetensorsReader for a compressed one.
        self._handles: dict[str, Any] = {}
        index_path = self.model_dir / INDEX_FILE
        single_path = self.model_dir / SINGLE_FILE
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, ValueError, KeyError) as exc:
                raise ModelLoadError(f"cannot read {index_path}: {exc}") from exc
            self._file_of: dict[str, str] = dict(weight_map)
        elif single_path.is_file():
            handle = self._open(SINGLE_FILE)
            keys = handle.names() if _is_compressed(handle) else handle.keys()
            self._file_of = dict.fromkeys(keys, SINGLE_FILE)
        else:
            raise ModelLoadError(
                f"no {SINGLE_FILE} or {INDEX_FILE} in {self.model_dir}: not a safetensors checkpoint"
            )
        missing = sorted({f for f in self._file_of.values() if not (self.model_dir / f).is_file()})
        if missing:
            raise ModelLoadError(f"checkpoint shard(s) missing in {self.model_dir}: {missing}")

    def _open(self, filename: str) -> Any:
        handle = self._handles.get(filename)
        if handle is None:
            path = self.model_dir / filename
            try:
                if is_compressed_checkpoint(path):
                    handle = self._stack.enter_context(CompressedSafetensorsReader(path))
                else:
                    handle = self._stack.enter_context(safe_open(str(path), framework="pt"))
            except Exception as exc:  # safetensors and the codec raise their own error types
                raise ModelLoadError(f"cannot open {path}: {exc}") from exc
            self._handles[filename] = handle
        return handle

    def _handle_for(self, name: str) -> Any:
        filename = self._file_of.get(name)
        if filename is None:
            raise ModelLoadError(f"tensor {name} is not in the checkpoint at {self.model_dir}")
        return self._open(filename)

    def names(self) -> list[str]:
        """All tensor names, grouped by shard so that iterating reads each file sequentially."""
        return sorted(self._file_of, key=lambda n: (self._file_of[n], n))

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def get(self, name: str) -> torch.Tensor:
        handle = self._handle_for(name)
        if not _is_compressed(handle):
            return handle.get_tensor(name)
        with _as_load_error():
            return handle.get(name)

    def get_compressed(self, name: str) -> CompressedTensor | None:
        """The checksummed compressed form of ``name``, or None when it is stored as is."""
        handle = self._handle_for(name)
        if not _is_compressed(handle):
            return None
        with _as_load_error():
            return handle.get_compressed(name)

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Read ``tensor[..., start:stop, ...]`` along ``dim`` without loading the rest.

        A compressed tensor's chunks do not map to slices, so it is decoded whole, then sliced.
        """
        rank = len(self.shape(name))
        if not -rank <= dim < rank:
            raise ValueError(f"dim {dim} out of range for {rank}-d tensor {name}")
        index = [slice(None)] * rank
        index[dim % rank] = slice(start, stop)
        handle = self._handle_for(name)
        if _is_compressed(handle):
            return self.get(name)[tuple(index)].clone()  # clone: free the rest of the tensor
        return handle.get_slice(name)[tuple(index)]

    def _header(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype code, shape) of ``name`` from the file headers, nothing decoded."""
        handle = self._handle_for(name)
        if _is_compressed(handle):
            with _as_load_error():
                return handle.header_info(name)
        view = handle.get_slice(name)
        return view.get_dtype(), tuple(view.get_shape())

    def shape(self, name: str) -> tuple[int, ...]:
        return self._header(name)[1]

    def dtype(self, name: str) -> torch.dtype:
        code = self._header(name)[0]
        if code not in _SAFETENSORS_DTYPES:
            raise ModelLoadError(f"tensor {name} has unsupported dtype {code}")
        return _SAFETENSORS_DTYPES[code]

    def close(self) -> None:
        self._handles.clear()
        self._stack.close()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _is_compressed(handle: Any) -> bool:
    return isinstance(handle, CompressedSafetensorsReader)


@contextmanager
def _as_load_error() -> Iterator[None]:
    """Report codec failures (checksum, layout, format version) as the engine's load error.

    The codec's message already names the file and tensor; it may be a later tensor than the one
    asked for, as the reader decodes several consecutive tensors together.
    """
    try:
        yield
    except CompressionError as exc:
        raise ModelLoadError(f"cannot load compressed weights: {exc}") from exc


def _progress_bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return nullcontext(None)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    progress = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    progress.add_task("Loading weights", total=total)
    return progress


def _iter_with_progress(names: list[str], progress: Any) -> Iterator[str]:
    for name in names:
        yield name
        if progress is not None:
            progress.advance(progress.task_ids[0])


def load_weights(
    module: nn.Module,
    reader: CheckpointReader,
    name_map: Callable[[str], str | None],
    dtype: torch.dtype,
    show_progress: bool | None = None,
    optional: set[str] | None = None,
) -> None:
    """Copy every checkpoint tensor into the parameter ``name_map(name)`` of ``module``.

    ``name_map`` returns ``None`` for tensors the model does not use (e.g. ``rotary_emb.inv_freq``).
    Tensors are converted to ``dtype`` and then copied into the existing parameters (which keeps
    their device). Raises :class:`ModelLoadError` on a shape mismatch or when a parameter outside
    ``optional`` has no tensor; tensors without a matching parameter are ignored.
    """
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    names = reader.names()
    if show_progress is None:
        show_progress = sys.stderr.isatty()
    with _progress_bar(len(names), show_progress) as progress:
        for ckpt_name in _iter_with_progress(names, progress):
            target = name_map(ckpt_name)
            if target is None:
                logger.debug("skipping checkpoint tensor %s", ckpt_name)
                continue
            param = params.get(target)
            if param is None:
                logger.debug("ignoring checkpoint tensor %s (no parameter %s)", ckpt_name, target)
                continue
            shape = reader.shape(ckpt_name)
            if shape != tuple(param.shape):
                raise ModelLoadError(
                    f"shape mismatch for tensor {ckpt_name}: checkpoint has {list(shape)}, "
                    f"model parameter {target} expects {list(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(reader.get(ckpt_name).to(dtype))
            loaded.add(target)
    missing = [name for name in params if name not in loaded and name not in (optional or set())]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(f"missing tensor {missing[0]}{more} in checkpoint {reader.model_dir}")
