"""Decode attention tuned for the CPU: length-sorted groups, query heads folded per KV head.

The batched reference pads every sequence to the batch's longest context, so a mixed batch
gathers and multiplies far more keys than it uses (the engine benchmark measured attention at
~40% of a decode step that way); one call per sequence avoids the padding but pays a fixed
per-call cost that dominates small models. Here sequences are sorted by context length and
attended in groups of up to ``GROUP`` similar lengths (little padding, few calls), and the
``H / Hkv`` query heads sharing a KV head are rows of one query matrix, so grouped-query
attention needs no expanded copy of K/V.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from edgeinfer.kernels.triton_utils import cdiv

_HALF = (torch.float16, torch.bfloat16)
GROUP = 8


def paged_decode_attention_cpu(
    q: Tensor,  # [B, H, D]
    k_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: Tensor,
    block_tables: Tensor,  # [B, max_blocks]
    context_lens: Tensor,  # [B], cached tokens including the new one
    scale: float,
) -> Tensor:
    """Same contract as ``paged_decode_attention_ref``; returns [B, H, D] in q's dtype."""
    batch, heads, head_dim = q.shape
    _, page, kv_heads, _ = k_cache.shape
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not divide into {kv_heads} kv heads")
    fold = heads // kv_heads
    # Half caches: CPU attention is faster and more accurate in fp32 (upcast after the gather).
    compute = torch.float32 if q.dtype in _HALF else q.dtype
    out = torch.zeros(batch, heads, head_dim, dtype=q.dtype)
    lens = context_lens.tolist()
    if max(lens, default=0) > block_tables.shape[1] * page:
        raise ValueError(f"context length {max(lens)} exceeds block_tables capacity")
    order = sorted((b for b in range(batch) if lens[b] > 0), key=lambda b: lens[b])
    for start in range(0, len(order), GROUP):
        rows = order[start : start + GROUP]
        length = lens[rows[-1]]  # the longest of the group (sorted ascending)
        n = cdiv(length, page)
        idx = torch.tensor(rows)
        pages = block_tables.index_select(0, idx)[:, :n].reshape(-1).long()  # [g * n]
        g = len(rows)
        # [g*n, page, Hkv, D] -> [g, Hkv, L, D] with L = n * page
        k = k_cache.index_select(0, pages).to(compute).view(g, n * page, kv_heads, head_dim)
        v = v_cache.index_select(0, pages).to(compute).view(g, n * page, kv_heads, head_dim)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        qg = q.index_select(0, idx).to(compute).view(g, kv_heads, fold, head_dim)
        valid = torch.tensor([lens[b] for b in rows])
        mask = torch.arange(n * page)[None, :] < valid[:, None]  # [g, L]
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask[:, None, None, :], scale=scale)
        out.index_copy_(0, idx, o.reshape(g, heads, head_dim).to(q.dtype))
    return out
