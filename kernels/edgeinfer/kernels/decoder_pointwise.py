"""A decoder layer's pointwise ops compiled from C++ (``csrc/decoder_pointwise.cpp``).

RMSNorm (alone, or after the residual add), the rotary rotation of q and k in place, and
``silu(gate) * up``: one call and one pass over the rows each, where torch runs 2-5 ops and
passes. In a SmolLM2 prefill chunk those ops took ~45 ms of a 384-token chunk's ~340 ms in
float32 (2 EPYC cores): each pass reads activations the matmul before it has just pushed out
of cache.

float32 or bfloat16 CPU tensors; bf16 rounds where transformers' bf16 ops round (see the C++
file), so results equal the torch formulation up to float32 summation order.
:func:`supports` says whether the library built and takes a tensor; :func:`runs` also asks
the op's route (by token count, set from the engine's kernel trials: where the compiled op did
not beat the torch ops on this host, they run); callers keep the torch ops otherwise.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch
from torch import Tensor

from edgeinfer.kernels import native_build
from edgeinfer.kernels.kernel_choice import SizeRoute

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
OPS = ("rms_norm", "add_rms_norm", "rotate", "silu_mul")
# (op, dtype) -> the token counts (first dim) at which the op runs here; absent: every count.
_routes: dict[tuple[str, torch.dtype], SizeRoute] = {}


@functools.cache
def _library() -> dict[tuple[str, torch.dtype], Any] | None:
    """The entry points by (op, dtype), typed for ctypes; None where the library did not build."""
    lib = native_build.load("decoder_pointwise")
    if lib is None:
        return None
    i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    signatures = {
        "rms_norm": [ptr, i64, ptr, f32, i64, i64, ptr, i32],
        "add_rms_norm": [ptr, i64, ptr, i64, ptr, f32, i64, i64, ptr, ptr, i32],
        "rotate": [ptr, i64, i64, i64, i64, i64, ptr, ptr, i32],
        "silu_mul": [ptr, i64, i64, i64, ptr, i32],
    }
    entries = {}
    for name, argtypes in signatures.items():
        for dtype, suffix in _SUFFIX.items():
            fn = getattr(lib, f"edgeinfer_{name}_{suffix}")
            fn.argtypes = argtypes
            fn.restype = None
            entries[name, dtype] = fn
    return entries


def available() -> bool:
    """Whether the library is built and loaded (compiles it on first call)."""
    return _library() is not None


def supports(x: Tensor) -> bool:
    """Whether these ops take ``x`` (float32 or bfloat16, on the CPU, with the library built)."""
    return x.dtype in _SUFFIX and x.device.type == "cpu" and available()


def runs(op: str, x: Tensor) -> bool:
    """Whether ``op`` (one of :data:`OPS`) takes ``x`` here: :func:`supports` and the op's
    route at ``x``'s token count (its first dim)."""
    if not supports(x):
        return False
    route = _routes.get((op, x.dtype))
    return route is None or route(x.shape[0] if x.dim() else 1)


def entry_address(op: str, dtype: torch.dtype) -> int | None:
    """``op``'s C entry point for ``dtype`` as an address (for compiled callers such as
    :mod:`decode_layers`); None where the library did not build or takes no such dtype."""
    entries = _library()
    if entries is None or (op, dtype) not in entries:
        return None
    return ctypes.cast(entries[op, dtype], ctypes.c_void_p).value


def set_route(op: str, dtype: torch.dtype, route: SizeRoute | None) -> None:
    """Where ``op`` on ``dtype`` tensors runs from now on (None: wherever it takes them)."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}: one of {', '.join(OPS)}")
    if route is None:
        _routes.pop((op, dtype), None)
    else:
        _routes[op, dtype] = route


def _fn(name: str, x: Tensor) -> Any:
    entries = _library()
    if entries is None:
        raise RuntimeError("the native decoder pointwise kernels are not available on this host")
    if x.dtype not in _SUFFIX or x.device.type != "cpu":
        raise ValueError(f"float32 or bfloat16 CPU tensors only, got {x.dtype} on {x.device}")
    return entries[name, x.dtype]


def _rows(x: Tensor, cols: int, what: str) -> Tensor:
    """``x`` as ``[rows, cols]`` with contiguous rows (a view where possible)."""
    if x.shape[-1:] != (cols,):
        raise ValueError(f"{what} {tuple(x.shape)} does not end in {cols}")
    x2 = x.reshape(-1, cols)
    return x2 if x2.stride(1) == 1 else x2.contiguous()


def _width(weight: Tensor, x: Tensor) -> int:
    if weight.dim() != 1 or weight.dtype != x.dtype or not weight.is_contiguous():
        raise ValueError(f"weight {tuple(weight.shape)} {weight.dtype} does not fit {x.dtype} rows")
    return weight.shape[0]


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps))`` over the last dim, rounded as transformers."""
    fn = _fn("rms_norm", x)
    cols = _width(weight, x)
    x2 = _rows(x, cols, "x")
    out = torch.empty(x.shape, dtype=x.dtype)
    fn(x2.data_ptr(), x2.stride(0), weight.data_ptr(), eps, x2.shape[0], cols, out.data_ptr(),
       torch.get_num_threads())  # fmt: skip
    return out


def add_rms_norm(x: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(x + delta, rms_norm(x + delta))``: the residual add and the next norm in one pass."""
    fn = _fn("add_rms_norm", x)
    cols = _width(weight, x)
    if delta.shape != x.shape or delta.dtype != x.dtype:
        raise ValueError(
            f"delta {tuple(delta.shape)} {delta.dtype} does not fit x {tuple(x.shape)}"
        )
    x2, d2 = _rows(x, cols, "x"), _rows(delta, cols, "delta")
    total = torch.empty(x.shape, dtype=x.dtype)
    out = torch.empty(x.shape, dtype=x.dtype)
    fn(x2.data_ptr(), x2.stride(0), d2.data_ptr(), d2.stride(0), weight.data_ptr(), eps,
       x2.shape[0], cols, total.data_ptr(), out.data_ptr(), torch.get_num_threads())  # fmt: skip
    return total, out


def rotate_(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """Rotate ``x [T, H, D]`` in place by ``cos``/``signed_sin`` (``[T, D]`` or ``[T, 1, D]``
    in x's dtype, see :class:`~edgeinfer.daemon.engine.rope.Rotation`); returns ``x``."""
    fn = _fn("rotate", x)
    if x.dim() != 3 or x.stride(2) != 1 or x.shape[2] % 2:
        raise ValueError(f"x must be [T, H, D] with contiguous, even D, got {tuple(x.shape)}")
    tokens, heads, dim = x.shape
    tables = []
    for table in (cos, signed_sin):
        if table.numel() != tokens * dim or table.dtype != x.dtype or not table.is_contiguous():
            raise ValueError(f"cos/sin {tuple(table.shape)} {table.dtype} do not fit x")
        tables.append(table)
    if tokens and heads:
        fn(x.data_ptr(), x.stride(0), x.stride(1), tokens, heads, dim, tables[0].data_ptr(),
           tables[1].data_ptr(), torch.get_num_threads())  # fmt: skip
    return x


def silu_mul(gate_up: Tensor) -> Tensor:
    """``silu(gate) * up`` for ``gate_up [..., 2 * I]`` (gate, then up); ``[..., I]``."""
    fn = _fn("silu_mul", gate_up)
    width = gate_up.shape[-1]
    if width % 2:
        raise ValueError(f"gate_up's last dim must be even, got {tuple(gate_up.shape)}")
    g2 = _rows(gate_up, width, "gate_up")
    out = torch.empty((*gate_up.shape[:-1], width // 2), dtype=gate_up.dtype)
    fn(g2.data_ptr(), g2.stride(0), g2.shape[0], width // 2, out.data_ptr(),
       torch.get_num_threads())  # fmt: skip
    return out
