"""Triton availability checks shared by the kernel modules.

Triton is an optional dependency (x86_64 dev/gpu extras only), so kernel modules must import
cleanly without it and fall back to their torch paths.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

import torch


@functools.cache
def _import_triton() -> ModuleType | None:
    # Cached: a failed import is slow to repeat and the answer cannot change in-process.
    try:
        import triton
    except ImportError:
        return None
    return triton


def triton_interpret() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def has_triton() -> bool:
    """True when the `triton` package can be imported."""
    return _import_triton() is not None


def triton_available() -> bool:
    """True when Triton kernels can actually run: triton imports and there is either a CUDA
    device or the interpreter is enabled (which runs kernels on CPU tensors)."""
    return has_triton() and (torch.cuda.is_available() or triton_interpret())


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints (launch-grid and tile counts)."""
    return -(-a // b)


def num_sms(device: torch.device) -> int:
    """Streaming-multiprocessor count of a CUDA device (used to size split-K grids); a fixed
    small value for CPU tensors under the interpreter, where parallelism is irrelevant."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_k_factor(programs: int, max_len: int, device: torch.device) -> int:
    """Flash-decoding split count from shapes only (so it is CUDA-graph safe): enough programs
    to fill the GPU twice, but no split shorter than 256 tokens, where the cost of merging the
    partial results would outweigh the extra parallelism."""
    target = 2 * num_sms(device)
    if programs >= target:
        return 1
    return max(1, min(cdiv(target, programs), max_len // 256, 64))
