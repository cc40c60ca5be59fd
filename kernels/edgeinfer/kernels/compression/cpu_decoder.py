"""Decode compressed tensors on the CPU: compiled (numba) when installed, numpy otherwise.

Both backends decode bit for bit the same; numba is about 5x faster on one core (see
``docs/ARCHITECTURE.md``). ``EDGEINFER_CPU_DECODER=numpy`` forces the fallback, e.g. to compare.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch

from edgeinfer.kernels.compression.format import CompressedTensor

Backend = Literal["numba", "numpy"]
BACKENDS: tuple[Backend, ...] = ("numba", "numpy")


def default_backend() -> Backend:
    """numba when importable (unless EDGEINFER_CPU_DECODER=numpy), else numpy."""
    if os.environ.get("EDGEINFER_CPU_DECODER") == "numpy":
        return "numpy"
    return "numba" if _numba_installed() else "numpy"


@functools.cache
def _numba_installed() -> bool:
    # Cached: find_spec scans sys.path (tens of microseconds), and this runs per decode call.
    return importlib.util.find_spec("numba") is not None


def decode_cpu(tensor: CompressedTensor, backend: Backend | None = None) -> torch.Tensor:
    """Decode one tensor to a CPU torch tensor of its dtype and shape, bit for bit."""
    return decode_many_cpu([tensor], backend)[0]


def decode_many_cpu(
    tensors: Sequence[CompressedTensor], backend: Backend | None = None
) -> list[torch.Tensor]:
    """Decode several tensors (numpy shares its per-call overhead among them), in input order."""
    cpu = [t.to("cpu") for t in tensors]
    words: list[np.ndarray]
    if (backend or default_backend()) == "numba":
        from edgeinfer.kernels.compression.numba_decoder import decode_words_numba

        words = [decode_words_numba(t) for t in cpu]
    else:
        from edgeinfer.kernels.compression.numpy_decoder import decode_words_numpy

        words = decode_words_numpy(cpu)
    return [
        torch.from_numpy(w).view(torch.int16).view(t.torch_dtype).reshape(t.shape)
        for t, w in zip(cpu, words, strict=True)
    ]
