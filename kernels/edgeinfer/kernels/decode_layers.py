"""A small decode step's decoder layers in one compiled call (``csrc/decode_layers.cpp``).

The C++ side only sequences the other compiled kernels (skinny GEMM, the pointwise ops, decode
attention) through their entry points, which :func:`ops` collects here: a step of one to eight
rows then runs its Llama layers without returning to Python between ops. The structures below
mirror the C++ ones field for field; callers (the engine's ``fused_decode``) fill them with
the model's panels, norm weights and caches once, and with each step's rows and scratch.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from edgeinfer.kernels import decoder_pointwise, native_build, skinny_gemm

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64


class Ops(ctypes.Structure):
    """Mirror of ``Ops``: the kernels of one dtype."""

    _fields_ = [(name, _ptr) for name in (
        "gemm", "rms_norm", "add_rms_norm", "rotate", "silu_mul", "attention",
    )]  # fmt: skip


class Layer(ctypes.Structure):
    """Mirror of ``Layer``: one layer's panels, norm weights, biases (0: none) and caches."""

    _fields_ = [(name, _ptr) for name in (
        "input_norm", "post_norm", "qkv", "qkv_bias", "o", "o_bias", "gate_up", "gate_up_bias",
        "down", "down_bias", "k_cache", "v_cache",
    )]  # fmt: skip


class Dims(ctypes.Structure):
    """Mirror of ``Dims``."""

    _fields_ = [
        *((name, _i64) for name in (
            "hidden", "heads", "kv_heads", "head_dim", "inter", "elem_size",
        )),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
    ]  # fmt: skip


class Step(ctypes.Structure):
    """Mirror of ``Step``: one step's rows, rotation, KV slots, attention problem, scratch."""

    _fields_ = [
        ("rows", _i64),
        *((name, _ptr) for name in (
            "x", "slots", "cos", "signed_sin", "attention", "normed", "qkv", "attn", "o",
            "total", "gate_up", "act", "down",
        )),
    ]  # fmt: skip


@functools.cache
def _entries() -> dict[torch.dtype, Any] | None:
    lib = native_build.load("decode_layers")
    if lib is None:
        return None
    entries = {}
    for dtype, suffix in _SUFFIX.items():
        fn = getattr(lib, f"edgeinfer_decode_layers_{suffix}")
        fn.argtypes = [
            ctypes.POINTER(Ops), ctypes.POINTER(Layer), _i64, ctypes.POINTER(Dims),
            ctypes.POINTER(Step), ctypes.c_int,
        ]  # fmt: skip
        fn.restype = ctypes.c_int
        entries[dtype] = fn
    return entries


def ops(dtype: torch.dtype, attention: int | None, panels: torch.dtype | None = None) -> Ops | None:
    """The kernels this library sequences for ``dtype``, with ``attention`` the decode
    attention's entry point (:meth:`PreparedDecode.entry_address`) and the projections' panels
    held in ``panels`` (default ``dtype``; see :attr:`SkinnyWeight.halved`); None where any of
    them, or this library, is not built here."""
    if _entries() is None or dtype not in _SUFFIX:
        return None
    addresses = [
        skinny_gemm.entry_address(dtype, panels),
        *(decoder_pointwise.entry_address(op, dtype) for op in (
            "rms_norm", "add_rms_norm", "rotate", "silu_mul",
        )),
        attention,
    ]  # fmt: skip
    if any(a is None for a in addresses):
        return None
    return Ops(*addresses)


def available(dtype: torch.dtype) -> bool:
    """Whether this library and the kernels it calls are built for ``dtype`` tensors."""
    return (
        _entries() is not None
        and dtype in _SUFFIX
        and skinny_gemm.entry_address(dtype) is not None
        and decoder_pointwise.available()
    )


def run(
    dtype: torch.dtype,
    kernels: Ops,
    layers: ctypes.Array[Layer],
    dims: Dims,
    step: Step,
    threads: int,
) -> None:
    """Run every layer of ``layers`` on ``step`` (its ``x`` is overwritten with the output)."""
    entries = _entries()
    if entries is None:
        raise RuntimeError("the native decode-layers library is not available on this host")
    status = entries[dtype](
        ctypes.byref(kernels), layers, len(layers), ctypes.byref(dims), ctypes.byref(step),
        threads,
    )  # fmt: skip
    if status == 1:
        raise ValueError("a projection refused its sizes (more rows than the kernel takes?)")
    if status == 2:
        raise MemoryError("decode attention could not allocate its scratch")
