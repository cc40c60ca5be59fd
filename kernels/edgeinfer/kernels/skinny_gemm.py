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

A float32 weight whose values are all bfloat16 values (a float32 model loaded from a bf16
checkpoint: SmolLM2's) keeps its panels in bfloat16, widened back to float32 as the kernel loads
them: the same products and sums, bit for bit, from half the bytes, so a float32 decode step on
a CPU without bf16 dot products streams as many bytes as a bf16 one would.

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

    # float32: [ceil(out / width), in, width] (float32, or bfloat16 where every weight is a
    # bfloat16 value); bfloat16: [ceil(out / 16), ceil(in / 2), 16, 2]; outputs past `out` (and
    # bf16's input past an odd `in`) zero
    panels: Tensor
    out_features: int
    in_features: int
    max_rows: int  # rows one call takes
    route: SizeRoute | None = None  # the row counts it runs at; None: every one it takes
    dtype: torch.dtype = torch.float32  # of x, the bias and the output

    @property
    def halved(self) -> bool:
        """Float32 arithmetic on panels held in bfloat16 (exact weights, half the bytes)."""
        return self.dtype == torch.float32 and self.panels.dtype == torch.bfloat16

    @property
    def label(self) -> str:
        """Its dtype, and the panels' where they differ (as kernel trials name their cases: a
        verdict holds only for the layout it timed)."""
        name = str(self.dtype).removeprefix("torch.")
        return f"{name} (bfloat16 panels)" if self.halved else name

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
        # (x's dtype, the panels' dtype) -> entry point
        self.gemm = {
            (torch.float32, torch.float32): lib.edgeinfer_skinny_gemm_f32,
            (torch.float32, torch.bfloat16): lib.edgeinfer_skinny_gemm_f32w16,
            (torch.bfloat16, torch.bfloat16): lib.edgeinfer_skinny_gemm_bf16,
        }
        for gemm in self.gemm.values():
            gemm.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, ptr, ctypes.c_int]
            gemm.restype = ctypes.c_int

    def panel_shape(self, dtype: torch.dtype, out_features: int, in_features: int) -> tuple:
        """The panels' shape for a ``dtype`` weight of this size (the float32 layout also for
        float32 held in bfloat16), in this build (``()`` for bfloat16 in a build without its
        kernel)."""
        if dtype == torch.bfloat16:
            if not self.bf16_panel:
                return ()
            return (-(-out_features // self.bf16_panel), -(-in_features // 2), self.bf16_panel, 2)
        return (-(-out_features // self.panel), in_features, self.panel)

    def has(self, dtype: torch.dtype, panels: torch.dtype) -> bool:
        """Whether this build computes in ``dtype`` on panels held in ``panels``."""
        return (dtype, panels) in self.gemm and (dtype != torch.bfloat16 or self.bf16_panel > 0)


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


def entry_address(dtype: torch.dtype, panels: torch.dtype | None = None) -> int | None:
    """The C entry point for ``dtype`` rows on panels held in ``panels`` (default: ``dtype``),
    as an address (for compiled callers such as :mod:`decode_layers`); None where the library
    or that kernel is missing."""
    kernel = _kernel()
    key = (dtype, panels or dtype)
    if kernel is None or not kernel.has(*key):
        return None
    return ctypes.cast(kernel.gemm[key], ctypes.c_void_p).value


def bf16_exact(weight: Tensor) -> bool:
    """Whether every value of a float32 ``weight`` is a bfloat16 value (its low 16 bits zero),
    so that panels in bfloat16 hold it exactly."""
    if weight.dtype != torch.float32:
        return False
    return not bool((weight.detach().contiguous().view(torch.int32) & 0xFFFF).any())


def prepare(weight: Tensor, *, halve: bool | None = None) -> SkinnyWeight | None:
    """``weight [out, in]`` (float32, or bfloat16 where :func:`takes_bf16`; CPU) in panels, or
    None where the kernel cannot take it. A float32 weight's panels are held in bfloat16 where
    that is exact (:func:`bf16_exact`); ``halve=False`` keeps them float32."""
    kernel = _kernel()
    if (
        kernel is None
        or weight.dtype not in (torch.float32, torch.bfloat16)
        or not kernel.has(weight.dtype, weight.dtype)
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
    store = weight.dtype
    if weight.dtype == torch.float32 and halve is not False and bf16_exact(weight):
        store = torch.bfloat16
    padded = weight.detach().new_zeros(count * panel, inputs, dtype=store)
    padded[:out_features, :in_features] = weight.detach()
    # [count, panel, in] -> [count, in, panel]: a panel's row k is its outputs' weights for input
    # k; bf16 by pairs of inputs, [count, panel, in / 2, 2] -> [count, in / 2, panel, 2]
    panels = padded.view(count, panel, shape[1], -1).transpose(1, 2).contiguous().view(shape)
    return SkinnyWeight(panels, out_features, in_features, kernel.max_rows, dtype=weight.dtype)


def skinny_linear(x: Tensor, weight: SkinnyWeight, bias: Tensor | None = None) -> Tensor:
    """``x [..., in] @ weight.T + bias``, ``[..., out]``, for at most :func:`max_rows` rows of
    ``x`` on the CPU, in the weight's dtype (bfloat16: float32 sums, rounded once at the end)."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the native skinny-GEMM kernel is not available on this host")
    out_features, in_features, dtype = weight.out_features, weight.in_features, weight.dtype
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
        kernel.gemm[dtype, weight.panels.dtype](
            x2.data_ptr(), x2.stride(0), weight.panels.data_ptr(),
            None if bias is None else bias.data_ptr(),
            rows, in_features, out_features, y.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
    return y
