"""``x @ weight.T + bias`` for a few rows of ``x``, compiled from C++ (``csrc/skinny_gemm.cpp``).

A decode step of one or two sequences multiplies one or two activation rows into every weight
of the model: the step is a stream through the weights, and its speed is the bandwidth that
stream reaches. oneDNN's packed matmul reached ~30 GB/s on SmolLM2's projections (2 EPYC
cores, float32) where a plain read of the same tensors reaches ~40; this kernel streams eight
weight rows per thread and reached 33-43 GB/s at one row. At four rows and more the dot
products, not the memory, bound the step and oneDNN's blocked kernels are faster, so callers
use this one only up to :data:`MAX_ROWS` rows (``bench/cpu_kernels.py`` measures both).

float32, or bfloat16 (input, weight, bias and output; products summed in float32 and
rounded once). The weight must be a plain contiguous ``[out, in]`` tensor: oneDNN's packed
layout is opaque.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import Tensor

from edgeinfer.kernels import native_build

# Rows up to which the kernel beats oneDNN's packed matmul (see the module docstring).
MAX_ROWS = 2
_DTYPES = (torch.float32, torch.bfloat16)


class _Kernel:
    def __init__(self, lib: ctypes.CDLL) -> None:
        lib.edgeinfer_skinny_max_rows.restype = ctypes.c_int64
        lib.edgeinfer_skinny_max_in.restype = ctypes.c_int64
        self.max_rows = int(lib.edgeinfer_skinny_max_rows())
        self.max_in = int(lib.edgeinfer_skinny_max_in())
        self.entry = {}
        for dtype, suffix in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
            fn = getattr(lib, f"edgeinfer_skinny_gemm_{suffix}")
            i64, ptr = ctypes.c_int64, ctypes.c_void_p
            fn.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, ptr, ctypes.c_int]
            fn.restype = ctypes.c_int
            self.entry[dtype] = fn


@functools.cache
def _kernel() -> _Kernel | None:
    lib = native_build.load("skinny_gemm")
    return None if lib is None else _Kernel(lib)


def available() -> bool:
    """Whether the library is built and loaded (compiles it on first call)."""
    return _kernel() is not None


def supports_weight(weight: Tensor) -> bool:
    """Whether the kernel can read ``weight`` (plain, contiguous, float32 or bfloat16, CPU)."""
    kernel = _kernel()
    return (
        kernel is not None
        and weight.device.type == "cpu"
        and weight.dtype in _DTYPES
        and weight.dim() == 2
        and not weight.is_mkldnn
        and weight.is_contiguous()
        and 0 < weight.shape[1] <= kernel.max_in
        and weight.shape[0] > 0
    )


def skinny_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x [..., in] @ weight.T + bias``, ``[..., out]``, for at most the library's maximum
    rows (4) of ``x``, all tensors of one dtype (float32 or bfloat16) on the CPU."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the native skinny-GEMM kernel is not available on this host")
    if not supports_weight(weight):
        raise ValueError(
            f"the weight must be a contiguous 2-D float32 or bfloat16 CPU tensor with at most "
            f"{kernel.max_in} columns, got {tuple(weight.shape)} {weight.dtype}"
        )
    out_features, in_features = weight.shape
    if x.dtype != weight.dtype or x.device.type != "cpu" or x.shape[-1:] != (in_features,):
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} does not fit weight {tuple(weight.shape)}")
    if bias is not None and (
        bias.shape != (out_features,) or bias.dtype != weight.dtype or not bias.is_contiguous()
    ):
        raise ValueError(f"bias {tuple(bias.shape)} {bias.dtype} does not fit the weight")
    rows = x.numel() // in_features
    if rows > kernel.max_rows:
        raise ValueError(f"{rows} rows is more than the kernel's {kernel.max_rows}")
    x2 = x.reshape(rows, in_features)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    y = torch.empty((*x.shape[:-1], out_features), dtype=x.dtype)
    if rows:
        kernel.entry[x.dtype](
            x2.data_ptr(), x2.stride(0), weight.data_ptr(),
            None if bias is None else bias.data_ptr(),
            rows, in_features, out_features, y.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
    return y
