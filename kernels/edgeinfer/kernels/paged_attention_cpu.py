"""Decode attention tuned for the CPU: one unmasked SDPA per sequence, heads folded.

The batched reference pads every sequence to the longest context and masks the padding, so
a mixed batch gathers and multiplies far more keys than it uses (the benchmark measured
attention at ~40% of a decode step that way). Here each sequence gathers exactly its own
pages, and the ``H / Hkv`` query heads that share a KV head become rows of one query matrix,
so grouped-query attention needs neither a mask nor an expanded copy of K/V.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from edgeinfer.kernels.triton_utils import cdiv

_HALF = (torch.float16, torch.bfloat16)


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
    group = heads // kv_heads
    # Half caches: CPU SDPA is faster and more accurate in fp32 (upcast right after the gather).
    compute = torch.float32 if q.dtype in _HALF else q.dtype
    out = torch.zeros(batch, heads, head_dim, dtype=q.dtype)
    lens = context_lens.tolist()
    for b, length in enumerate(lens):
        if length <= 0:
            continue
        n = cdiv(length, page)
        if n > block_tables.shape[1]:
            raise ValueError(f"context length {length} exceeds block_tables capacity")
        pages = block_tables[b, :n].long()
        # [n, page, Hkv, D] -> [Hkv, L, D]
        k = k_cache.index_select(0, pages).to(compute).view(-1, kv_heads, head_dim)[:length]
        v = v_cache.index_select(0, pages).to(compute).view(-1, kv_heads, head_dim)[:length]
        qb = q[b].view(kv_heads, group, head_dim).to(compute)  # [Hkv, G, D]
        o = F.scaled_dot_product_attention(qb, k.transpose(0, 1), v.transpose(0, 1), scale=scale)
        out[b] = o.reshape(heads, head_dim)
    return out
