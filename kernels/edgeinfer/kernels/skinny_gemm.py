"""``x @ weight.T + bias`` for a few rows of ``x``, compiled from C++ (``csrc/skinny_gemm.cpp``).

A decode step multiplies one row per sequence into every weight of the model: the step is a
stream through the weights, and its speed is the bandwidth that stream reaches. On SmolLM2's
projections (2 EPYC cores, float32) oneDNN's packed matmul read 20-30 GB/s at 1-8 rows, the
smaller weights worst (a fixed ~40 us per call); this kernel keeps the weight in panels of 16
outputs (``[ceil(out / 16), in, 16]``, made once by :func:`prepare`) and computes outer
products over them, no horizontal sums, several panels streaming at once: 1.4x oneDNN at one
row, 1.1x at eight (``bench/cpu_kernels.py``). The panel width is the build's vector width
(16 floats with AVX-512, 8 with AVX2). Callers use it up to :func:`max_rows` rows, at the row
counts where it beat oneDNN on this host (:attr:`SkinnyWeight.route`, set by the engine's
kernel trials).

bfloat16 weights get the same panels by pairs of inputs (``[ceil(out / 16), ceil(in / 2), 16,
2]``) and AVX512-BF16 dot products, float32 sums rounded once to bfloat16, where the build
targets a CPU that has them (:func:`takes_bf16`); elsewhere they stay on oneDNN. On SmolLM2's
decode step (2 Xeon cores with AMX) that read the bf16 weights at 26 GB/s against oneDNN's
17.7 at one row, and 1.05x its speed at eight.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from edgeinfer.kernels import native_build
from edgeinfer.kernels.kernel_choice import SizeRoute


@dataclass(eq=False)
class SkinnyWeight:
    """A ``[out, in]`` float32 or bfloat16 weight laid out in panels for :func:`skinny_linear`."""

    # float32: [ceil(out / width), in, width]; bfloat16: [ceil(out / 16), ceil(in / 2), 16, 2];
    # outputs past `out` (and bf16's input past an odd `in`) zero
    panels: Tensor
    out_features: int
    in_features: int
    max_rows: int  # rows one call takes
    route: SizeRoute | None = None  # the row counts it runs at; None: every one it takes

    def runs(self, rows: int) -> bool:
        """Whether a call of ``rows`` rows takes this kernel (else oneDNN)."""
        return 0 < rows <= self.max_rows and (self.route is None or self.route(rows))

    def retire(self) -> None:
        """Never run it (it lost at every row count): the panels' memory is given back."""
        self.route = SizeRoute({1: False})
        self.panels = self.panels.new_empty(0)


class _Kernel:
    def __init__(self, lib: ctypes.CDLL) -> None:
        lib.edgeinfer_skinny_max_rows.restype = ctypes.c_int64
        lib.edgeinfer_skinny_panel.restype = ctypes.c_int64
        lib.edgeinfer_skinny_bf16_panel.restype = ctypes.c_int64
        self.max_rows = int(lib.edgeinfer_skinny_max_rows())
        self.panel = int(lib.edgeinfer_skinny_panel())
        self.bf16_panel = int(lib.edgeinfer_skinny_bf16_panel())  # 0: no bf16 kernel built
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self.gemm = {
            torch.float32: lib.edgeinfer_skinny_gemm_f32,
            torch.bfloat16: lib.edgeinfer_skinny_gemm_bf16,
        }
        for gemm in self.gemm.values():
            gemm.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, ptr, ctypes.c_int]
            gemm.restype = ctypes.c_int

    def panel_shape(self, dtype: torch.dtype, out_features: int, in_features: int) -> tuple:
        """The panels' shape for a weight of this dtype and size, in this build (``()`` for
        bfloat16 in a build without its kernel)."""
        if dtype == torch.bfloat16:
            if not self.bf16_panel:
                return ()
            return (-(-out_features // self.bf16_panel), -(-in_features // 2), self.bf16_panel, 2)
        return (-(-out_features // self.panel), in_features, self.panel)


@functools.cache
def _kernel() -> _Kernel | None:
    lib = native_build.load("skinny_gemm")
    return None if lib is None else _Kernel(lib)


def available() -> bool:
    """Whether the library is built and loaded (compiles it on first call)."""
    return _kernel() is not None


def max_rows() -> int:
    """Rows of ``x`` one call takes (0 where the library did not build)."""
    kernel = _kernel()
    return 0 if kernel is None else kernel.max_rows


def takes_bf16() -> bool:
    """Whether this build has the bfloat16 kernel (AVX512-BF16 targets only)."""
    kernel = _kernel()
    return kernel is not None and kernel.bf16_panel > 0


def entry_address(dtype: torch.dtype) -> int | None:
    """The C entry point for ``dtype`` weights, as an address (for compiled callers such as
    :mod:`decode_layers`); None where the library or its kernel for ``dtype`` is missing."""
    kernel = _kernel()
    if (
        kernel is None
        or dtype not in kernel.gemm
        or (dtype == torch.bfloat16 and not kernel.bf16_panel)
    ):
        return None
    return ctypes.cast(kernel.gemm[dtype], ctypes.c_void_p).value


def prepare(weight: Tensor) -> SkinnyWeight | None:
    """``weight [out, in]`` (float32, or bfloat16 where :func:`takes_bf16`; CPU) in panels, or
    None where the kernel cannot take it."""
    kernel = _kernel()
    if (
        kernel is None
        or weight.dtype not in (torch.float32, torch.bfloat16)
        or (weight.dtype == torch.bfloat16 and not kernel.bf16_panel)
        or weight.device.type != "cpu"
        or weight.dim() != 2
        or weight.is_mkldnn
        or 0 in weight.shape
    ):
        return None
    out_features, in_features = weight.shape
    shape = kernel.panel_shape(weight.dtype, out_features, in_features)
    count, panel = shape[0], shape[2]
    inputs = shape[1] * (2 if weight.dtype == torch.bfloat16 else 1)  # bf16: even, zero-padded
    padded = weight.detach().new_zeros(count * panel, inputs)
    padded[:out_features, :in_features] = weight.detach()
    # [count, panel, in] -> [count, in, panel]: a panel's row k is its outputs' weights for input
    # k; bf16 by pairs of inputs, [count, panel, in / 2, 2] -> [count, in / 2, panel, 2]
    panels = padded.view(count, panel, shape[1], -1).transpose(1, 2).contiguous().view(shape)
    return SkinnyWeight(panels, out_features, in_features, kernel.max_rows)


def skinny_linear(x: Tensor, weight: SkinnyWeight, bias: Tensor | None = None) -> Tensor:
    """``x [..., in] @ weight.T + bias``, ``[..., out]``, for at most :func:`max_rows` rows of
    ``x`` on the CPU, in the weight's dtype (bfloat16: float32 sums, rounded once at the end)."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the native skinny-GEMM kernel is not available on this host")
    out_features, in_features, dtype = weight.out_features, weight.in_features, weight.panels.dtype
    if x.dtype != dtype or not x.is_cpu or x.shape[-1:] != (in_features,):
        raise ValueError(
            f"x {tuple(x.shape)} {x.dtype} does not fit a {dtype} weight of {in_features} inputs"
        )
    if bias is not None and (
        bias.shape != (out_features,) or bias.dtype != dtype or not bias.is_contiguous()
    ):
        raise ValueError(f"bias {tuple(bias.shape)} {bias.dtype} does not fit the weight")
    if weight.panels.shape != kernel.panel_shape(dtype, out_features, in_features):
        raise ValueError(
            "the weight's panels were given back (retire) or laid out for another build"
        )
    rows = x.numel() // in_features
    if rows > kernel.max_rows:
        raise ValueError(f"{rows} rows is more than the kernel's {kernel.max_rows}")
    # (a decode step calls this ~120 times: the cheapest torch calls that do the job, ~2 us less)
    x2 = x if x.dim() == 2 else x.reshape(rows, in_features)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    y = x.new_empty((*x.shape[:-1], out_features))
    if rows:
        kernel.gemm[dtype](
            x2.data_ptr(), x2.stride(0), weight.panels.data_ptr(),
            None if bias is None else bias.data_ptr(),
            rows, in_features, out_features, y.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
    return y
