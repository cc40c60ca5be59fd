"""Paged attention compiled from C++ (``csrc/``), run on torch's own OpenMP threads.

Both kernels read K/V in place from the paged cache, in float32 or bfloat16 (bf16 widened
exactly, the output rounded once), and share every key and value row among the ``H / Hkv``
query heads of its KV head, so grouped-query attention needs no expanded copy.

* Decode (``csrc/paged_decode_attention.cpp``): one query token per sequence, the same contract
  as :func:`~edgeinfer.kernels.paged_attention_numba.paged_decode_attention_numba`. Work units
  are a sequence and a range of its context, merged flash-decoding style, so batch 1 fills the
  cores too; a unit streams through its tokens' rows (all KV heads of a token are adjacent in a
  page). On SmolLM2-135M (9 query and 3 KV heads of 64, float32, 2 EPYC cores) a decode step
  of 8 sequences at ~300 tokens spent ~12 ms of ~35 ms in numba's single-threaded kernel, ~6 ms
  here.
* Prefill (``csrc/paged_prefill_attention.cpp``): a chunk of a sequence attends causally over
  its cached prefix and itself (flash attention over 64-key tiles, keys staged once per call
  transposed so a query's scores are vector FMAs over keys). Against torch's CPU flash kernel
  on SmolLM2's heads, float32: 1.2x at 224 tokens, 1.7-1.8x at 384-1024.

:func:`available` says whether the libraries built (see :mod:`edgeinfer.kernels.native_build`);
callers keep portable kernels for hosts where they did not, and where these lost to them when
timed at load (the engine's ``kernel_trials``; e.g. prefill at 1 thread on an AVX-512 Xeon, where
torch's flash SDPA was 1.0-2x faster).
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import Tensor

from edgeinfer.kernels import native_build

# Fewest keys one decode work unit attends: finer splits cost more in merging than they balance.
MIN_SPLIT_KEYS = 128
_DTYPES = (torch.float32, torch.bfloat16)


class _DecodeProblem(ctypes.Structure):
    """Mirror of ``DecodeProblem`` in csrc/decode_problem.h (same order, same types)."""

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


class _PrefillProblem(ctypes.Structure):
    """Mirror of ``Problem`` in paged_prefill_attention.cpp (same order, same types)."""

    _fields_ = [
        ("q", ctypes.c_void_p),
        ("q_stride_t", ctypes.c_int64),
        ("q_stride_h", ctypes.c_int64),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("table", ctypes.c_void_p),
        ("tokens", ctypes.c_int64),
        ("start_pos", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("dim", ctypes.c_int64),
        ("page", ctypes.c_int64),
        ("scale", ctypes.c_float),
        ("out", ctypes.c_void_p),
    ]


class _Kernel:
    """One library's entry points (``<prefix>_f32``, ``<prefix>_bf16``), typed for ctypes."""

    def __init__(self, lib: ctypes.CDLL, prefix: str, max_dim: str, problem: type) -> None:
        getattr(lib, max_dim).restype = ctypes.c_int64
        self.max_dim = int(getattr(lib, max_dim)())
        self.entry = {}
        for dtype, suffix in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
            fn = getattr(lib, f"{prefix}_{suffix}")
            fn.argtypes = [ctypes.POINTER(problem), ctypes.c_int]
            fn.restype = ctypes.c_int
            self.entry[dtype] = fn


@functools.cache
def _decode_kernel() -> _Kernel | None:
    lib = native_build.load("paged_decode_attention")
    if lib is None:
        return None
    return _Kernel(lib, "edgeinfer_paged_decode", "edgeinfer_decode_max_dim", _DecodeProblem)


@functools.cache
def _prefill_kernel() -> _Kernel | None:
    lib = native_build.load("paged_prefill_attention")
    if lib is None:
        return None
    return _Kernel(lib, "edgeinfer_paged_prefill", "edgeinfer_prefill_max_dim", _PrefillProblem)


def available() -> bool:
    """Whether both compiled kernels are built and loaded (compiles them on first call)."""
    return _decode_kernel() is not None and _prefill_kernel() is not None


def _fits(kernel: _Kernel | None, q: Tensor, k_cache: Tensor) -> bool:
    if kernel is None or q.device.type != "cpu" or q.dtype != k_cache.dtype:
        return False
    heads, head_dim = q.shape[-2:]
    return (
        q.dtype in _DTYPES
        and k_cache.dim() == 4
        and heads % k_cache.shape[2] == 0
        and head_dim <= kernel.max_dim
    )


def supports(q: Tensor, k_cache: Tensor) -> bool:
    """Whether the native kernels take these tensors (float32 or bfloat16 on the CPU, queries
    in the cache's dtype, whole groups of query heads per KV head, heads of <= 256 dims)."""
    return _fits(_decode_kernel(), q, k_cache) and _fits(_prefill_kernel(), q, k_cache)


def _check(kernel: _Kernel | None, q: Tensor, k_cache: Tensor, v_cache: Tensor) -> _Kernel:
    if kernel is None:
        raise RuntimeError("the native attention kernels are not available on this host")
    if not _fits(kernel, q, k_cache) or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"the native kernels take float32 or bfloat16 CPU tensors with heads of at most "
            f"{kernel.max_dim} dims, got {tuple(q.shape)} {q.dtype} over "
            f"{tuple(k_cache.shape)} {k_cache.dtype}"
        )
    if k_cache.shape != v_cache.shape or k_cache.shape[3] != q.shape[-1]:
        raise ValueError(f"caches {tuple(k_cache.shape)} do not fit q {tuple(q.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the K/V caches must be contiguous")
    return kernel


def _check_blocks(tables: Tensor, num_blocks: int) -> None:
    """The kernels read raw memory: every page they could touch must lie inside the cache.
    (numpy views: reductions of a few dozen ints cost ~1 us there, ~5 us as torch ops.)"""
    ids = tables.numpy()
    if ids.size and (int(ids.max()) >= num_blocks or int(ids.min()) < 0):
        raise ValueError("a block table names a block outside the cache")


def _output(q: Tensor, out: Tensor | None) -> Tensor:
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype)
    if out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {tuple(q.shape)} {q.dtype} tensor")
    return out


class PreparedDecode:
    """One step's decode attention, checked once for every layer that runs it.

    The block tables and context lengths are the same in every layer of a step; only q, the
    layer's caches and the output change. Checking the tables (every page inside the cache)
    and building the kernel's arguments once saves ~13 us per layer against
    :func:`paged_decode_attention_native`, ~0.4 ms of a SmolLM2 decode step of one sequence.
    """

    def __init__(
        self,
        block_tables: Tensor,  # [B, max_blocks] int32
        context_lens: Tensor,  # [B] int32, cached tokens including the new one; 0: a zero row
        cache_shape: tuple[int, ...],  # [num_blocks, block_size, Hkv, D] of every layer's caches
        dtype: torch.dtype,
        heads: int,
    ) -> None:
        kernel = _decode_kernel()
        if kernel is None:
            raise RuntimeError("the native attention kernels are not available on this host")
        if len(cache_shape) != 4 or dtype not in _DTYPES:
            raise ValueError(f"caches {tuple(cache_shape)} {dtype} are not float32/bf16 pages")
        num_blocks, page, kv_heads, head_dim = cache_shape
        if heads % kv_heads or head_dim > kernel.max_dim:
            raise ValueError(
                f"{heads} query heads over {kv_heads} KV heads of {head_dim} dims: the kernel "
                f"takes whole groups of heads of at most {kernel.max_dim} dims"
            )
        batch = block_tables.shape[0]
        if context_lens.shape != (batch,):
            raise ValueError("block_tables and context_lens need one row per query")
        tables = block_tables.to(torch.int32).contiguous()
        lens = context_lens.to(torch.int32).contiguous()
        if batch and int(lens.numpy().max()) > tables.shape[1] * page:
            raise ValueError("a context length exceeds its block table")
        _check_blocks(tables, num_blocks)
        self._entry = kernel.entry[dtype]
        self._tables, self._lens = tables, lens  # the problem points into them
        self._cache_shape = torch.Size(cache_shape)
        self._q_shape = torch.Size((batch, heads, head_dim))
        self._dtype = dtype
        self._problem = _DecodeProblem(
            0, 0, 0, 0, 0, tables.data_ptr(), tables.stride(0), lens.data_ptr(),
            batch, heads, kv_heads, head_dim, page, MIN_SPLIT_KEYS, 0.0, 0,
        )  # fmt: skip

    def problem_address(self) -> int:
        """The step's ``DecodeProblem`` (tables and lengths filled in) as an address, for a
        compiled caller that sets each layer's q, caches, scale and output itself
        (:mod:`decode_layers`)."""
        return ctypes.addressof(self._problem)

    def entry_address(self) -> int | None:
        """The kernel's entry point for this step's dtype, as an address (the same caller)."""
        return ctypes.cast(self._entry, ctypes.c_void_p).value

    def __call__(
        self,
        q: Tensor,  # [B, H, D]
        k_cache: Tensor,  # one layer's [num_blocks, block_size, Hkv, D]
        v_cache: Tensor,
        scale: float,
        out: Tensor | None = None,  # [B, H, D] contiguous, receives the result when given
    ) -> Tensor:
        if q.shape != self._q_shape or q.dtype != self._dtype or q.device.type != "cpu":
            raise ValueError(f"q {tuple(q.shape)} {q.dtype} does not fit the prepared step")
        for cache in (k_cache, v_cache):
            if cache.shape != self._cache_shape or cache.dtype != self._dtype:
                raise ValueError(f"cache {tuple(cache.shape)} does not fit the prepared step")
            if not cache.is_contiguous() or cache.device.type != "cpu":
                raise ValueError("the K/V caches must be contiguous CPU tensors")
        if q.stride(2) != 1:
            q = q.contiguous()
        out = _output(q, out)
        if not self._q_shape[0]:
            return out
        p = self._problem
        p.q, p.q_stride_b, p.q_stride_h = q.data_ptr(), q.stride(0), q.stride(1)
        p.k_cache, p.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
        p.scale, p.out = scale, out.data_ptr()
        if self._entry(ctypes.byref(p), torch.get_num_threads()):
            raise MemoryError("the native decode-attention kernel could not allocate its scratch")
        return out


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
    _check(_decode_kernel(), q, k_cache, v_cache)
    if block_tables.shape[0] != q.shape[0]:
        raise ValueError("block_tables and context_lens need one row per query")
    prepared = PreparedDecode(block_tables, context_lens, k_cache.shape, q.dtype, q.shape[1])
    return prepared(q, k_cache, v_cache, scale, out)


def paged_prefill_attention_native(
    q: Tensor,  # [T, H, D], the chunk's queries at positions start_pos .. start_pos + T - 1
    k_cache: Tensor,  # [num_blocks, block_size, Hkv, D], the chunk's own K/V already written
    v_cache: Tensor,
    block_table: Tensor,  # [>= cdiv(start_pos + T, block_size)] int32
    start_pos: int,
    scale: float,
    out: Tensor | None = None,  # [T, H, D] contiguous, receives the result when given
) -> Tensor:
    """Same contract as ``paged_prefill_attention_ref`` (causal over the cached prefix and the
    chunk itself) for float32 or bfloat16 CPU tensors."""
    kernel = _check(_prefill_kernel(), q, k_cache, v_cache)
    tokens, heads, head_dim = q.shape
    page = k_cache.shape[1]
    table = block_table.to(torch.int32).contiguous()
    if table.dim() != 1 or start_pos < 0 or table.numel() * page < start_pos + tokens:
        raise ValueError(
            f"the block table ({tuple(table.shape)}) does not cover {start_pos} + {tokens} tokens"
        )
    _check_blocks(table, k_cache.shape[0])
    if q.stride(2) != 1:
        q = q.contiguous()
    out = _output(q, out)
    if tokens == 0:
        return out
    problem = _PrefillProblem(
        q.data_ptr(), q.stride(0), q.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(),
        tokens, start_pos, heads, k_cache.shape[2], head_dim, page,
        scale, out.data_ptr(),
    )  # fmt: skip
    if kernel.entry[q.dtype](ctypes.byref(problem), torch.get_num_threads()):
        raise MemoryError("the native prefill-attention kernel could not allocate its scratch")
    return out
