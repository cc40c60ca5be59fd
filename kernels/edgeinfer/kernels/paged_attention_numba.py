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

float32 and bfloat16 caches: a bf16 value widens to float32 exactly (its 16 bits become the
top half of a float32), so the kernel reads bf16 pages as ``uint16`` and computes in float32;
queries and the result are float32 (the wrapper casts them). float16 keeps the torch path.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, types
from numba.extending import overload
from torch import Tensor

_CACHE_DTYPES = (torch.float32, torch.bfloat16)


def _widen(x):  # type: ignore[no-untyped-def]  # pragma: no cover - replaced when compiled
    """A cache value as float32 (compiled per cache dtype by the overload below)."""
    raise NotImplementedError


@overload(_widen, inline="always")
def _widen_impl(x):  # type: ignore[no-untyped-def]
    if isinstance(x, types.Float):
        return lambda x: np.float32(x)
    if x == types.uint16:
        # bfloat16 bits: the high half of the float32 with the same value.
        return lambda x: np.uint32(np.uint32(x) << 16).view(np.float32)
    return None


@njit(nogil=True, fastmath=True, cache=True, boundscheck=False)
def _one_head(  # pragma: no cover - compiled
    q: np.ndarray,  # [H, D] one sequence's queries
    k_cache: np.ndarray,  # [num_blocks, block_size, Hkv, D], float32 or bf16 bits (uint16)
    v_cache: np.ndarray,
    table: np.ndarray,  # [max_blocks]
    length: int,
    kv_head: int,
    scale: float,
    scores: np.ndarray,  # [fold, >= length] scratch
    acc: np.ndarray,  # [fold, D] scratch
    out: np.ndarray,  # [H, D]
) -> None:
    page = k_cache.shape[1]
    dim = q.shape[1]
    fold = scores.shape[0]
    first = kv_head * fold
    # Scores: each key row is loaded once for the fold query heads that read it.
    for t in range(length):
        block = table[t // page]
        krow = k_cache[block, t % page, kv_head]
        for f in range(fold):
            qrow = q[first + f]
            s = np.float32(0.0)
            for d in range(dim):
                s += qrow[d] * _widen(krow[d])
            scores[f, t] = s * scale
    for f in range(fold):
        top = scores[f, 0]
        for t in range(1, length):
            top = max(top, scores[f, t])
        total = np.float32(0.0)
        for t in range(length):
            e = np.exp(scores[f, t] - top)
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
        out[first + f, :] = acc[f, :]


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
    for item in range(batch * kv_heads):
        b = item // kv_heads
        kv_head = item % kv_heads
        length = lens[b]
        if length <= 0:
            out[b, kv_head * fold : (kv_head + 1) * fold, :] = 0.0
            continue
        scores = np.empty((fold, length), np.float32)
        acc = np.empty((fold, dim), np.float32)
        _one_head(q[b], k_cache, v_cache, tables[b], length, kv_head, scale, scores, acc, out[b])


def supports(q: Tensor, k_cache: Tensor) -> bool:
    """Whether :func:`paged_decode_attention_numba` takes these tensors (float32 or bfloat16
    on the CPU, queries in the cache's dtype)."""
    return q.device.type == "cpu" and q.dtype == k_cache.dtype and q.dtype in _CACHE_DTYPES


def _cache_array(cache: Tensor) -> np.ndarray:
    """The cache's memory as numpy: float32 as is, bfloat16 as its bits (``uint16``)."""
    if cache.dtype == torch.bfloat16:
        return cache.view(torch.int16).numpy().view(np.uint16)
    return cache.numpy()


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
    wide = q.dtype != torch.float32
    # Queries and the result are small ([B, H, D]): the casts cost less than computing in bf16.
    q32 = q.float() if wide else q.contiguous()
    out32 = torch.empty_like(q32) if wide else out
    # The caches are views of the engine's preallocated tensors: numpy shares their memory.
    _decode(
        q32.numpy(), _cache_array(k_cache), _cache_array(v_cache), block_tables.numpy(), lens,
        scale, out32.numpy(),
    )  # fmt: skip
    if wide:
        out.copy_(out32)
    return out
