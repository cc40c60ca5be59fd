"""Attention tuned for the CPU: decode in length-sorted groups, prefill on torch's flash kernel.

Decode: query heads folded per KV head, sequences grouped by context length.

The batched reference pads every sequence to the batch's longest context, so a mixed batch
gathers and multiplies far more keys than it uses; one call per sequence avoids the padding
but pays a fixed per-call cost that dominates small models. Here sequences are sorted by
context length and attended in groups of similar lengths (little padding, few calls): each group
gathers its pages once and runs one ``scaled_dot_product_attention``, with the ``H / Hkv`` query
heads sharing a KV head as rows of one query matrix, so grouped-query attention needs no
expanded copy of K/V.

The grouping depends only on the block tables and context lengths, which every layer of a step
shares: :func:`plan_decode_cpu` computes it once per step (from host lists, no tensor reads) and
each layer passes the :class:`DecodePlan` in. When the caller already orders its sequences by
context length, groups are contiguous row ranges and no query or output rows are copied.

Prefill: torch's CPU flash kernel does not take grouped-query inputs (``enable_gqa`` or a
boolean mask with unequal head counts send SDPA to its math path, which materialises the
``[H, T, L]`` scores: ~3x slower at 1024 tokens and hundreds of MB of page faults), so the
chunk's K/V heads are repeated up to the query heads first, a copy of ``T x H x D``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from edgeinfer.kernels.triton_utils import cdiv

_HALF = (torch.float16, torch.bfloat16)
# A group holds at most GROUP_TOKENS padded keys (its gathered K/V stays in cache: 3 MiB for
# SmolLM2's 3 x 64 fp32 KV heads) and only rows at least SPREAD times as long as its longest:
# fewer SDPA calls against less padding, measured on 1-64 sequences of 16-2048 tokens.
GROUP_TOKENS = 2048
SPREAD = 0.5


@dataclass(frozen=True)
class DecodeGroup:
    rows: slice | Tensor  # rows of q: a contiguous range, or [g] int64 indices
    length: int  # keys attended: the group's longest context
    pages: Tensor  # [g * n] int64, the first n = cdiv(length, page) blocks of each row
    mask: Tensor | None  # [g, 1, 1, length] bool, True = attend; None when all rows use all


@dataclass(frozen=True)
class DecodePlan:
    batch: int
    groups: list[DecodeGroup]
    covers_all: bool  # every row is in a group (no row with an empty context)


def plan_decode_cpu(
    block_tables: Sequence[Sequence[int]] | Tensor,  # [B, max_blocks]
    context_lens: Sequence[int] | Tensor,  # [B]
    page: int,
) -> DecodePlan:
    """Group the batch's sequences for :func:`paged_decode_attention_cpu`."""
    lens = context_lens.tolist() if isinstance(context_lens, Tensor) else list(context_lens)
    tables = block_tables.tolist() if isinstance(block_tables, Tensor) else block_tables
    for b, length in enumerate(lens):
        if length > len(tables[b]) * page:
            raise ValueError(f"context length {length} exceeds block_tables capacity")
    order = sorted((b for b in range(len(lens)) if lens[b] > 0), key=lambda b: lens[b])
    groups: list[DecodeGroup] = []
    stop = len(order)
    while stop:
        # Longest first: the group takes shorter rows while they are long enough.
        longest = lens[order[stop - 1]]
        start = stop - 1
        fits = max(GROUP_TOKENS // longest, 1)
        while start > 0 and stop - start < fits and lens[order[start - 1]] >= SPREAD * longest:
            start -= 1
        rows = order[start:stop]
        n = cdiv(longest, page)
        # Shorter rows are padded with block 0: its keys are masked out.
        pages = torch.tensor(
            [p for b in rows for p in [*tables[b][:n], *[0] * (n - len(tables[b][:n]))]],
            dtype=torch.long,
        )
        mask = None
        if lens[rows[0]] != longest:
            valid = torch.tensor([lens[b] for b in rows])
            mask = (torch.arange(longest)[None, :] < valid[:, None])[:, None, None, :]
        contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
        index = slice(rows[0], rows[-1] + 1) if contiguous else torch.tensor(rows)
        groups.append(DecodeGroup(index, longest, pages, mask))
        stop = start
    return DecodePlan(len(lens), groups, covers_all=len(order) == len(lens))


def paged_decode_attention_cpu(
    q: Tensor,  # [B, H, D]
    k_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: Tensor,
    block_tables: Tensor,  # [B, max_blocks]
    context_lens: Tensor,  # [B], cached tokens including the new one
    scale: float,
    plan: DecodePlan | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """Same contract as ``paged_decode_attention_ref``; returns [B, H, D] in q's dtype.

    ``plan`` is :func:`plan_decode_cpu` of these tables and lengths (computed here if None);
    ``out`` [B, H, D], when given, receives the result."""
    batch, heads, head_dim = q.shape
    _, page, kv_heads, _ = k_cache.shape
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not divide into {kv_heads} kv heads")
    fold = heads // kv_heads
    if plan is None:
        plan = plan_decode_cpu(block_tables, context_lens, page)
    if plan.batch != batch:
        raise ValueError(f"the decode plan is for {plan.batch} sequences, q holds {batch}")
    # Half caches: CPU attention is faster and more accurate in fp32 (upcast after the gather).
    compute = torch.float32 if q.dtype in _HALF else q.dtype
    if out is None:
        out = q.new_empty(batch, heads, head_dim)
    if not plan.covers_all:
        out.zero_()  # rows without context attend to nothing
    for group in plan.groups:
        length = group.length
        g = group.pages.numel() // cdiv(length, page)
        # [g*n, page, Hkv, D] -> [g, Hkv, length, D]: a strided view, SDPA reads it in place.
        k = k_cache.index_select(0, group.pages).view(g, -1, kv_heads, head_dim)[:, :length]
        v = v_cache.index_select(0, group.pages).view(g, -1, kv_heads, head_dim)[:, :length]
        qg = q[group.rows].view(g, kv_heads, fold, head_dim)
        if compute != q.dtype:
            k, v, qg = k.to(compute), v.to(compute), qg.to(compute)
        o = F.scaled_dot_product_attention(
            qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=group.mask, scale=scale
        )
        out[group.rows] = o.view(g, heads, head_dim).to(out.dtype)
    return out


def prefill_attention_cpu(
    q: Tensor,  # [T, H, D], positions start_pos .. start_pos + T - 1
    k: Tensor,  # [L, Hkv, D], positions 0 .. L - 1, L = start_pos + T
    v: Tensor,
    scale: float,
    start_pos: int = 0,
) -> Tensor:
    """Causal attention of a prompt chunk over its own and all earlier keys; [T, H, D]."""
    chunk, heads, _ = q.shape
    length, kv_heads, _ = k.shape
    if length != start_pos + chunk:
        raise ValueError(f"{length} keys for a chunk of {chunk} at position {start_pos}")
    fold = heads // kv_heads
    # Heads first: q [1, H, T, D], k/v [1, H, L, D] with each KV head repeated `fold` times.
    q4 = q.transpose(0, 1).unsqueeze(0)
    k4 = k.transpose(0, 1).repeat_interleave(fold, dim=0).unsqueeze(0)
    v4 = v.transpose(0, 1).repeat_interleave(fold, dim=0).unsqueeze(0)
    if start_pos == 0:
        o = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale)
    else:
        # is_causal aligns the chunk with the first keys; the prefix needs an explicit mask.
        positions = torch.arange(length, device=q.device)
        mask = positions[None, :] <= positions[start_pos:, None]  # [T, L]
        o = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=scale)
    return o[0].transpose(0, 1)


def paged_prefill_attention_cpu(
    q: Tensor,  # [T, H, D]
    k_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: Tensor,
    block_table: Tensor,  # [max_blocks], covers start_pos + T tokens
    start_pos: int,
    scale: float,
) -> Tensor:
    """Same contract as ``paged_prefill_attention_ref``: the chunk's K/V are already cached."""
    length = start_pos + q.shape[0]
    _, page, kv_heads, head_dim = k_cache.shape
    n = cdiv(length, page)
    if n > block_table.shape[0]:
        raise ValueError(f"{length} tokens exceed block_table capacity {block_table.shape[0]}")
    pages = block_table[:n].long()
    k = k_cache.index_select(0, pages).view(-1, kv_heads, head_dim)[:length]  # [L, Hkv, D]
    v = v_cache.index_select(0, pages).view(-1, kv_heads, head_dim)[:length]
    return prefill_attention_cpu(q, k, v, scale, start_pos)
