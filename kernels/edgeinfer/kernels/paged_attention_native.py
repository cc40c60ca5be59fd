"""Decode attention compiled from C++ (``csrc/paged_decode_attention.cpp``) on torch's threads.

The same contract as :func:`~edgeinfer.kernels.paged_attention_numba.paged_decode_attention_numba`
(float32 or bfloat16 CPU tensors, K/V read in place from their pages, the ``H / Hkv`` query
heads of a KV head sharing each row it reads), with two differences that make it faster: it
runs on every torch thread (OpenMP work units of one sequence and a range of its context, merged
flash-decoding style, so even batch 1 fills the cores; a unit streams through its tokens' rows,
every KV head of a token being adjacent in the page), and g++ vectorises its
softmax with glibc's vector ``expf``. On SmolLM2-135M (9 query and 3 KV heads of 64, float32,
2 EPYC cores) a decode step of 8 sequences at ~300 tokens spent ~12 ms of its ~35 ms in numba's
single-threaded kernel.

:func:`available` says whether the library built (see :mod:`edgeinfer.kernels.native_build`);
callers fall back to numba's kernel when it did not.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import Tensor

from edgeinfer.kernels import native_build

_LIBRARY = "paged_decode_attention"
# Fewest keys one work unit attends: splitting finer costs more in merging than it balances.
MIN_SPLIT_KEYS = 128


class _Problem(ctypes.Structure):
    """Mirror of ``Problem`` in the C++ source (same order, same types)."""

    _fields_ = [
        ("q", ctypes.c_void_p),
        ("q_stride_b", ctypes.c_int64),
        ("q_stride_h", ctypes.c_int64),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("tables", ctypes.c_void_p),
        ("table_stride", ctypes.c_int64),
        ("lens", ctypes.c_void_p),
        ("batch", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("dim", ctypes.c_int64),
        ("page", ctypes.c_int64),
        ("min_split", ctypes.c_int64),
        ("scale", ctypes.c_float),
        ("out", ctypes.c_void_p),
    ]


class _Kernel:
    """The library's entry points, typed for ctypes."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        lib.edgeinfer_decode_max_dim.restype = ctypes.c_int64
        self.max_dim = int(lib.edgeinfer_decode_max_dim())
        self.entry = {}
        for dtype, symbol in (
            (torch.float32, "edgeinfer_paged_decode_f32"),
            (torch.bfloat16, "edgeinfer_paged_decode_bf16"),
        ):
            fn = getattr(lib, symbol)
            fn.argtypes = [ctypes.POINTER(_Problem), ctypes.c_int]
            fn.restype = ctypes.c_int
            self.entry[dtype] = fn


@functools.cache
def _kernel() -> _Kernel | None:
    lib = native_build.load(_LIBRARY)
    return None if lib is None else _Kernel(lib)


def available() -> bool:
    """Whether the compiled kernel is built and loaded (compiles it on first call)."""
    return _kernel() is not None


def supports(q: Tensor, k_cache: Tensor) -> bool:
    """Whether :func:`paged_decode_attention_native` takes these tensors."""
    kernel = _kernel()
    if kernel is None or q.device.type != "cpu" or q.dtype != k_cache.dtype:
        return False
    heads, head_dim = q.shape[-2:]
    kv_heads = k_cache.shape[2]
    return q.dtype in kernel.entry and heads % kv_heads == 0 and head_dim <= kernel.max_dim


def paged_decode_attention_native(
    q: Tensor,  # [B, H, D]
    k_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: Tensor,
    block_tables: Tensor,  # [B, max_blocks] int32
    context_lens: Tensor,  # [B] int32, cached tokens including the new one; 0: a zero row
    scale: float,
    out: Tensor | None = None,  # [B, H, D] contiguous, receives the result when given
) -> Tensor:
    """Same contract as ``paged_decode_attention_ref`` for float32 or bfloat16 CPU tensors."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the native decode-attention kernel is not available on this host")
    batch, heads, head_dim = q.shape
    if not supports(q, k_cache) or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"the native kernel takes float32 or bfloat16 CPU tensors with heads of at most "
            f"{kernel.max_dim} dims, got "
            f"{tuple(q.shape)} {q.dtype} over {tuple(k_cache.shape)} {k_cache.dtype}"
        )
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4 or k_cache.shape[3] != head_dim:
        raise ValueError(f"caches {tuple(k_cache.shape)} do not fit q {tuple(q.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the K/V caches must be contiguous")
    if block_tables.shape[0] != batch or context_lens.shape != (batch,):
        raise ValueError("block_tables and context_lens need one row per query")
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    page = k_cache.shape[1]
    # The kernel reads raw memory: every page it could touch must lie inside the cache.
    # (numpy views: reductions of a few dozen ints cost ~1 us there, ~5 us as torch ops.)
    lens_np, tables_np = lens.numpy(), tables.numpy()
    if batch and int(lens_np.max()) > tables.shape[1] * page:
        raise ValueError("a context length exceeds its block table")
    if tables.numel() and (int(tables_np.max()) >= k_cache.shape[0] or int(tables_np.min()) < 0):
        raise ValueError("a block table names a block outside the cache")
    if q.stride(2) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {tuple(q.shape)} {q.dtype} tensor")
    if batch == 0:
        return out
    problem = _Problem(
        q.data_ptr(), q.stride(0), q.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(),
        tables.data_ptr(), tables.stride(0), lens.data_ptr(),
        batch, heads, k_cache.shape[2], head_dim, page, MIN_SPLIT_KEYS,
        scale, out.data_ptr(),
    )  # fmt: skip
    if kernel.entry[q.dtype](ctypes.byref(problem), torch.get_num_threads()):
        raise MemoryError("the native decode-attention kernel could not allocate its scratch")
    return out
