"""Decode attention compiled for the CPU (numba): K/V read in place from their pages.

The torch path (:mod:`edgeinfer.kernels.paged_attention_cpu`) gathers each sequence's pages
into a contiguous copy for ``scaled_dot_product_attention``: every cached byte is read, written
and read again, and rows of unequal length are padded or split into several calls. Here one
compiled loop per (sequence, KV head) walks the block table and reads each key and value row
once where it lies, for all ``H / Hkv`` query heads that share it (grouped-query attention
without an expanded copy). On SmolLM2-135M's shapes (3 KV heads of 64, batch 8, ~300 tokens of
context) that is about half the torch path's time per layer on one core.

One thread: numba's parallel layers bring a second thread pool (its ``omp`` layer loads the
system's libgomp beside the copy torch bundles), whose spinning workers fight torch's for the
cores; decode attention is a small part of a step next to the weights' matmuls.

float32 and bfloat16: a bf16 value widens to float32 exactly (its 16 bits become the top half
of a float32), so bf16 queries and pages are read as their bits (``uint16``), everything is
computed in float32 and the result is rounded once to bf16 (to nearest even, as torch casts),
with no cast of q or the output around the call. float16 keeps the torch path.

The softmax's exponentials use a polynomial (Cephes' ``expf``: range reduction by powers of
two, degree-6 polynomial, within 2 ulp): plain arithmetic that LLVM vectorizes, where a call to
libm's ``expf`` per score runs one at a time (numba's wheels have no SVML).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, types
from numba.extending import overload
from torch import Tensor

_DTYPES = (torch.float32, torch.bfloat16)
_LOG2E = np.float32(1.4426950408889634)
# ln 2 split in two so n * _LN2_HI is exact for the n that occur (Cody-Waite reduction).
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)


def _widen(x):  # pragma: no cover - replaced when compiled
    """A stored value as float32 (compiled per dtype by the overload below)."""
    raise NotImplementedError


@overload(_widen, inline="always")
def _widen_impl(x):
    if isinstance(x, types.Float):
        return lambda x: np.float32(x)
    if x == types.uint16:
        # bfloat16 bits: the high half of the float32 with the same value.
        return lambda x: np.uint32(np.uint32(x) << 16).view(np.float32)
    return None


def _narrow(x, like):  # pragma: no cover - replaced when compiled
    """float32 ``x`` in the storage type of ``like`` (compiled per dtype)."""
    raise NotImplementedError


@overload(_narrow, inline="always")
def _narrow_impl(x, like):
    if isinstance(like, types.Float):
        return lambda x, like: np.float32(x)
    if like == types.uint16:

        def to_bf16_bits(x, like):
            bits = np.float32(x).view(np.uint32)
            # Round to nearest, ties to even, on the 16 bits that are dropped (finite x).
            odd = (bits >> np.uint32(16)) & np.uint32(1)
            return np.uint16((bits + np.uint32(0x7FFF) + odd) >> np.uint32(16))

        return to_bf16_bits
    return None


@njit(inline="always", fastmath=True)
def _exp_nonpositive(x):  # pragma: no cover - compiled
    """e^x for x <= 0 (a score minus its row's maximum); below -87 it returns ~1e-38."""
    x = max(x, np.float32(-87.0))
    n = np.floor(x * _LOG2E + np.float32(0.5))
    r = x - n * _LN2_HI - n * _LN2_LO  # |r| <= ln(2) / 2
    poly = np.float32(1.9875691500e-4) * r + np.float32(1.3981999507e-3)
    poly = poly * r + np.float32(8.3334519073e-3)
    poly = poly * r + np.float32(4.1665795894e-2)
    poly = poly * r + np.float32(1.6666665459e-1)
    poly = poly * r + np.float32(5.0000001201e-1)
    e_r = poly * (r * r) + r + np.float32(1.0)
    # 2^n built from its exponent bits (n >= -126 after the clamp above).
    two_n = np.uint32(np.uint32(np.int32(n) + np.int32(127)) << np.uint32(23)).view(np.float32)
    return e_r * two_n


@njit(nogil=True, fastmath=True, cache=True, boundscheck=False)
def _one_head(  # pragma: no cover - compiled
    q: np.ndarray,  # [H, D] one sequence's queries (float32, or bf16 bits as uint16)
    k_cache: np.ndarray,  # [num_blocks, block_size, Hkv, D], q's dtype
    v_cache: np.ndarray,
    table: np.ndarray,  # [max_blocks]
    length: int,
    kv_head: int,
    scale: np.float32,
    scores: np.ndarray,  # [fold, >= length] float32 scratch
    acc: np.ndarray,  # [fold, D] float32 scratch
    qs: np.ndarray,  # [fold, D] float32 scratch
    out: np.ndarray,  # [H, D], q's dtype
) -> None:
    page = k_cache.shape[1]
    dim = q.shape[1]
    fold = scores.shape[0]
    first = kv_head * fold
    for f in range(fold):
        for d in range(dim):
            qs[f, d] = _widen(q[first + f, d]) * scale
    # Scores: each key row is loaded once for the fold query heads that read it.
    for t in range(length):
        block = table[t // page]
        krow = k_cache[block, t % page, kv_head]
        for f in range(fold):
            s = np.float32(0.0)
            for d in range(dim):
                s += qs[f, d] * _widen(krow[d])
            scores[f, t] = s
    for f in range(fold):
        top = scores[f, 0]
        for t in range(1, length):
            top = max(top, scores[f, t])
        total = np.float32(0.0)
        for t in range(length):
            e = _exp_nonpositive(scores[f, t] - top)
            scores[f, t] = e
            total += e
        norm = np.float32(1.0) / total
        for t in range(length):
            scores[f, t] *= norm
        acc[f, :] = 0.0
    for t in range(length):
        block = table[t // page]
        vrow = v_cache[block, t % page, kv_head]
        for f in range(fold):
            p = scores[f, t]
            for d in range(dim):
                acc[f, d] += p * _widen(vrow[d])
    for f in range(fold):
        for d in range(dim):
            out[first + f, d] = _narrow(acc[f, d], out[first + f, d])


@njit(nogil=True, fastmath=True, cache=True, boundscheck=False)
def _decode(  # pragma: no cover - compiled
    q: np.ndarray,  # [B, H, D]
    k_cache: np.ndarray,  # [num_blocks, block_size, Hkv, D]
    v_cache: np.ndarray,
    tables: np.ndarray,  # [B, max_blocks]
    lens: np.ndarray,  # [B]
    scale: float,
    out: np.ndarray,  # [B, H, D]
) -> None:
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    fold = heads // kv_heads
    width = 1
    for b in range(batch):
        width = max(width, lens[b])
    scores = np.empty((fold, width), np.float32)
    acc = np.empty((fold, dim), np.float32)
    qs = np.empty((fold, dim), np.float32)
    for item in range(batch * kv_heads):
        b = item // kv_heads
        kv_head = item % kv_heads
        length = lens[b]
        if length <= 0:
            for h in range(kv_head * fold, (kv_head + 1) * fold):
                for d in range(dim):
                    out[b, h, d] = 0
            continue
        _one_head(
            q[b], k_cache, v_cache, tables[b], length, kv_head, np.float32(scale),
            scores, acc, qs, out[b],
        )  # fmt: skip


def supports(q: Tensor, k_cache: Tensor) -> bool:
    """Whether :func:`paged_decode_attention_numba` takes these tensors (float32 or bfloat16
    on the CPU, queries in the cache's dtype)."""
    return q.device.type == "cpu" and q.dtype == k_cache.dtype and q.dtype in _DTYPES


def _as_numpy(t: Tensor) -> np.ndarray:
    """The tensor's memory as numpy (shared): float32 as is, bfloat16 as its bits (``uint16``)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def paged_decode_attention_numba(
    q: Tensor,  # [B, H, D]
    k_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: Tensor,
    block_tables: Tensor,  # [B, max_blocks] integer
    context_lens: Tensor,  # [B], cached tokens including the new one; 0: a zero row
    scale: float,
    out: Tensor | None = None,  # [B, H, D], receives the result when given
) -> Tensor:
    """Same contract as ``paged_decode_attention_ref`` for float32 or bfloat16 CPU tensors."""
    batch, heads, head_dim = q.shape
    if not supports(q, k_cache) or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"the numba kernel takes float32 or bfloat16 CPU tensors, got {q.dtype} {q.device}"
        )
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4 or k_cache.shape[3] != head_dim:
        raise ValueError(f"caches {tuple(k_cache.shape)} do not fit q {tuple(q.shape)}")
    if heads % k_cache.shape[2]:
        raise ValueError(f"{heads} query heads do not divide into {k_cache.shape[2]} kv heads")
    if block_tables.shape[0] != batch or context_lens.shape != (batch,):
        raise ValueError("block_tables and context_lens need one row per query")
    page = k_cache.shape[1]
    lens = context_lens.numpy()
    if batch and int(lens.max()) > block_tables.shape[1] * page:
        raise ValueError("a context length exceeds its block table")
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    # The caches are views of the engine's preallocated tensors: numpy shares their memory, and
    # q may be a strided slice of the step's q|k|v (numba reads any strides).
    _decode(
        _as_numpy(q), _as_numpy(k_cache), _as_numpy(v_cache), block_tables.numpy(), lens,
        scale, _as_numpy(out),
    )  # fmt: skip
    return out
