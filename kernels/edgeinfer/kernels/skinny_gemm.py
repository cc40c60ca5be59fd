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

float32 only: bf16 weights stay on oneDNN, whose bf16 dot products read them faster.
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
    """A ``[out, in]`` float32 weight laid out in panels for :func:`skinny_linear`."""

    panels: Tensor  # [ceil(out / width), in, width], outputs past `out` zero
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
        self.max_rows = int(lib.edgeinfer_skinny_max_rows())
        self.panel = int(lib.edgeinfer_skinny_panel())
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self.gemm = lib.edgeinfer_skinny_gemm_f32
        self.gemm.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, ptr, ctypes.c_int]
        self.gemm.restype = ctypes.c_int


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


def prepare(weight: Tensor) -> SkinnyWeight | None:
    """``weight [out, in]`` (float32, CPU) in panels, or None where the kernel cannot take it."""
    kernel = _kernel()
    if (
        kernel is None
        or weight.dtype != torch.float32
        or weight.device.type != "cpu"
        or weight.dim() != 2
        or weight.is_mkldnn
        or 0 in weight.shape
    ):
        return None
    out_features, in_features = weight.shape
    count = -(-out_features // kernel.panel)
    padded = weight.detach().new_zeros(count * kernel.panel, in_features)
    padded[:out_features] = weight.detach()
    # [count, panel, in] -> [count, in, panel]: a panel's row k is its outputs' weights for input k
    panels = padded.view(count, kernel.panel, in_features).transpose(1, 2).contiguous()
    return SkinnyWeight(panels, out_features, in_features, kernel.max_rows)


def skinny_linear(x: Tensor, weight: SkinnyWeight, bias: Tensor | None = None) -> Tensor:
    """``x [..., in] @ weight.T + bias``, ``[..., out]``, for at most :func:`max_rows` rows of
    float32 ``x`` on the CPU."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the native skinny-GEMM kernel is not available on this host")
    out_features, in_features = weight.out_features, weight.in_features
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1:] != (in_features,):
        raise ValueError(
            f"x {tuple(x.shape)} {x.dtype} does not fit a float32 weight of {in_features} inputs"
        )
    if bias is not None and (
        bias.shape != (out_features,) or bias.dtype != torch.float32 or not bias.is_contiguous()
    ):
        raise ValueError(f"bias {tuple(bias.shape)} {bias.dtype} does not fit the weight")
    if weight.panels.shape != (-(-out_features // kernel.panel), in_features, kernel.panel):
        raise ValueError(
            "the weight's panels were given back (retire) or laid out for another build"
        )
    rows = x.numel() // in_features
    if rows > kernel.max_rows:
        raise ValueError(f"{rows} rows is more than the kernel's {kernel.max_rows}")
    x2 = x.reshape(rows, in_features)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    y = torch.empty((*x.shape[:-1], out_features), dtype=x.dtype)
    if rows:
        kernel.gemm(
            x2.data_ptr(), x2.stride(0), weight.panels.data_ptr(),
            None if bias is None else bias.data_ptr(),
            rows, in_features, out_features, y.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
    return y
