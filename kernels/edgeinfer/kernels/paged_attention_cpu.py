"""Attention tuned for the CPU: decode in length-sorted groups, prefill on torch's flash kernel.

Decode: query heads folded per KV head, sequences grouped by context length.

The batched reference pads every sequence to the batch's longest context, so a mixed batch
gathers and multiplies far more keys than it uses; one call per sequence avoids the padding
but pays a fixed per-call cost that dominates small models. Here sequences are sorted by
context length and attended in groups of similar lengths (little padding, few calls): each group
gathers its pages once and runs one ``scaled_dot_product_attention``, with the ``H / Hkv`` query
heads sharing a KV head as rows of one query matrix, so grouped-query attention needs no
expanded copy of K/V.

How to group is a cost trade: each group costs one SDPA call plus its padded keys, and a group
whose gathered K/V leaves the L2 cache pays 2-3x per key; :func:`plan_decode_cpu` takes the
cheapest split under a measured model of both. It depends only on the block tables, context
lengths and key width, which every layer of a step shares: the engine plans once per step (from
host lists, no tensor reads) and each layer passes the :class:`DecodePlan` in. When the caller already orders its sequences by
context length, groups are contiguous row ranges and no query or output rows are copied.

Prefill runs on torch's CPU flash kernel, which does not take grouped-query inputs (``enable_gqa``
or a boolean mask with unequal head counts send SDPA to its math path, which materialises the
``[H, T, L]`` scores: ~3x slower at 1024 tokens and hundreds of MB of page faults), so the
chunk's K/V heads are repeated up to the query heads first, a copy of ``T x H x D``. After a
cached prefix the chunk can instead attend *grouped*: the query heads of one KV head as rows of
one matrix, as decode does, with the mask's rows repeated. That reads each cached key once per
KV head, not once per query head, and skips the copy: on 2 EPYC cores (AVX2, float32,
SmolLM2's 9 / 3 heads) 1.4-3.5x faster for 14 tokens after 752 cached and 1.3-1.9x for 14-64 after
4,000, but 1.2x slower for 1,024 after 4,000 (the repeated mask), so the engine times both at load
and groups only the chunk sizes where it wins. bf16 on CPUs with bf16 dot products instead runs
as blocked matmuls after a cached prefix and for long chunks (:func:`_prefill_attention_matmul`),
where the flash kernel is 1.5-3x slower.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from edgeinfer.kernels.cpu_features import native_bf16
from edgeinfer.kernels.triton_utils import cdiv

_HALF = (torch.float16, torch.bfloat16)

# The grouping's cost model, in nanoseconds, measured on 2 AMD EPYC cores with torch 2.13 for
# groups of 1-64 rows of 16-1024 keys: one SDPA call (dispatch, mask, allocation), and one padded
# key of ``key_bytes`` (K plus V) bytes, gathered and multiplied.
CALL_NS = 25_000.0
KEY_NS = 20.0
KEY_BYTE_NS = 0.045
# The most K+V bytes one group gathers: half of a 1 MiB L2 (2048 keys of 2 x 16 fp32 heads).
# Measured, a key read from L3 or DRAM costs 2-3x one read from L2, which outweighs the calls
# that bigger groups save.
GROUP_BYTES = 512 << 10

# bf16 prefill runs as matmuls (:func:`_prefill_attention_matmul`) after a cached prefix, or
# from this many tokens: torch's flash kernel needs an explicit mask there (2-3x slower than
# the matmuls at 64-2048 tokens after a 512-token prefix on 2 EPYC cores), and from ~1k tokens
# the matmuls win anyway (0.5-0.7x its time); below, the two are within noise of each other.
MATMUL_MIN_CHUNK = 1024
# Scores of one block of query rows (bytes); larger blocks measured as fast or faster.
MATMUL_SCORE_BYTES = 4 << 20


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


def int_tensor(values: array, dtype: torch.dtype) -> Tensor:
    """A CPU tensor over ``values`` (typecode matching ``dtype``), without copying: several
    times faster than ``torch.tensor`` of a list of Python ints, which checks every element."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(values, dtype=dtype)


def plan_decode_cpu(
    block_tables: Sequence[Sequence[int]] | Tensor,  # [B][>= cdiv(len, page)] block ids
    context_lens: Sequence[int] | Tensor,  # [B]
    page: int,
    key_bytes: int,  # K plus V bytes of one cached token in one layer
) -> DecodePlan:
    """Group the batch's sequences for :func:`paged_decode_attention_cpu` at the least cost
    under the model above: a dynamic programme over the length-sorted rows (groups are
    contiguous runs of them), each group's gathered K/V capped at ``GROUP_BYTES``."""
    lens = context_lens.tolist() if isinstance(context_lens, Tensor) else list(context_lens)
    tables = block_tables.tolist() if isinstance(block_tables, Tensor) else block_tables
    for b, length in enumerate(lens):
        if length > len(tables[b]) * page:
            raise ValueError(f"context length {length} exceeds block_tables capacity")
    order = sorted((b for b in range(len(lens)) if lens[b] > 0), key=lens.__getitem__)
    sorted_lens = [lens[b] for b in order]
    key_ns = KEY_NS + KEY_BYTE_NS * key_bytes
    max_keys = max(GROUP_BYTES // key_bytes, 1)
    # A row padded by more keys than a call costs is cheaper in a group of its own, so an
    # optimal group never spans more than this many keys of length: it bounds the search.
    max_spread = CALL_NS / key_ns
    # best[j]: cheapest cost of the first j sorted rows; start[j]: where its last group starts.
    best = [0.0] * (len(order) + 1)
    start = [0] * (len(order) + 1)
    lo = 0
    for j in range(1, len(order) + 1):
        longest = sorted_lens[j - 1]
        while sorted_lens[lo] < longest - max_spread:
            lo += 1
        per_row = key_ns * longest
        first = max(j - max(max_keys // longest, 1), lo)  # rows a group of this length holds
        cost, arg = float("inf"), j - 1
        for i in range(j - 1, first - 1, -1):
            c = best[i] + per_row * (j - i)
            if c < cost:
                cost, arg = c, i
        best[j], start[j] = cost + CALL_NS, arg
    bounds: list[tuple[int, int]] = []  # [first, stop) of each group in sorted order
    stop = len(order)
    while stop:
        bounds.append((start[stop], stop))
        stop = start[stop]
    return _build(bounds, order, tables, lens, page)


def _build(
    bounds: list[tuple[int, int]],
    order: list[int],
    block_tables: Sequence[Sequence[int]],
    lens: list[int],
    page: int,
) -> DecodePlan:
    """Groups over sorted rows ``order[first:stop]``: each row's first ``cdiv(longest, page)``
    pages, shorter tables padded with block 0, whose keys the mask hides."""
    pages = array("q")
    spans: list[tuple[int, int]] = []  # each group's range in `pages`
    for first, stop in bounds:
        n = cdiv(lens[order[stop - 1]], page)
        begin = len(pages)
        for b in order[first:stop]:
            table = block_tables[b][:n]
            pages.extend(table)
            if len(table) < n:
                pages.extend([0] * (n - len(table)))
        spans.append((begin, len(pages)))
    # One conversion for the step: each group's pages and lengths are views of these.
    all_pages = int_tensor(pages, torch.long)
    sorted_lens = int_tensor(array("q", [lens[b] for b in order]), torch.long)
    positions = torch.arange(max((lens[b] for b in order), default=0))
    groups: list[DecodeGroup] = []
    for (first, stop), (begin, end) in zip(bounds, spans, strict=True):
        rows = order[first:stop]
        longest = lens[rows[-1]]
        mask = None
        if lens[rows[0]] != longest:
            valid = sorted_lens[first:stop, None]
            mask = (positions[None, :longest] < valid)[:, None, None, :]  # [g, 1, 1, longest]
        contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
        index = slice(rows[0], rows[-1] + 1) if contiguous else torch.tensor(rows)
        groups.append(DecodeGroup(index, longest, all_pages[begin:end], mask))
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
        key_bytes = 2 * kv_heads * head_dim * k_cache.element_size()
        plan = plan_decode_cpu(block_tables, context_lens, page, key_bytes)
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


def bf16_matmul_prefill(dtype: torch.dtype, start_pos: int, chunk: int) -> bool:
    """Whether a prefill chunk runs as bf16 matmuls (see MATMUL_MIN_CHUNK) on this CPU."""
    return (
        dtype == torch.bfloat16 and (start_pos > 0 or chunk >= MATMUL_MIN_CHUNK) and native_bf16()
    )


def prefill_attention_cpu(
    q: Tensor,  # [T, H, D], positions start_pos .. start_pos + T - 1
    k: Tensor,  # [L, Hkv, D], positions 0 .. L - 1, L = start_pos + T
    v: Tensor,
    scale: float,
    start_pos: int = 0,
    grouped: bool = False,
) -> Tensor:
    """Causal attention of a prompt chunk over its own and all earlier keys; [T, H, D].
    ``grouped``: after a cached prefix, the query heads of a KV head as rows of one matrix
    (module doc; :func:`_prefill_attention_grouped`)."""
    chunk, heads, _ = q.shape
    length, kv_heads, _ = k.shape
    if length != start_pos + chunk:
        raise ValueError(f"{length} keys for a chunk of {chunk} at position {start_pos}")
    if bf16_matmul_prefill(q.dtype, start_pos, chunk):
        return _prefill_attention_matmul(q, k, v, scale, start_pos)
    fold = heads // kv_heads
    if grouped and start_pos and fold > 1:
        return _prefill_attention_grouped(q, k, v, scale, start_pos)
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


def _prefill_attention_grouped(
    q: Tensor,  # [T, H, D]
    k: Tensor,  # [L, Hkv, D]
    v: Tensor,
    scale: float,
    start_pos: int,
) -> Tensor:
    """:func:`prefill_attention_cpu` on the flash kernel with K/V as they are: a KV head's
    query heads are rows of one query matrix, the mask's rows repeated to match."""
    chunk, heads, dim = q.shape
    length, kv_heads, _ = k.shape
    fold = heads // kv_heads
    # [1, Hkv, T * fold, D], row t * fold + f: query head kv * fold + f of token t.
    qh = q.view(chunk, kv_heads, fold, dim).transpose(0, 1).reshape(1, kv_heads, -1, dim)
    positions = torch.arange(length, device=q.device)
    mask = positions[None, :] <= positions[start_pos:, None]  # [T, L]
    o = F.scaled_dot_product_attention(
        qh,
        k.transpose(0, 1).unsqueeze(0),  # [1, Hkv, L, D]
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask.repeat_interleave(fold, dim=0),  # [T * fold, L]
        scale=scale,
    )
    return o[0].view(kv_heads, chunk, fold, dim).transpose(0, 1).reshape(chunk, heads, dim)


def _prefill_attention_matmul(
    q: Tensor,  # [T, H, D] bfloat16
    k: Tensor,  # [L, Hkv, D]
    v: Tensor,
    scale: float,
    start_pos: int,
) -> Tensor:
    """:func:`prefill_attention_cpu` as bf16 matmuls and a softmax, in blocks of query rows.

    The computation of transformers' eager attention in bf16 (scores rounded to bf16, softmax
    accumulated in float32, probabilities rounded to bf16), blocked so a block's scores stay
    near the caches. The query heads of one KV head are rows of one matrix, so grouped-query
    attention reads K/V in place, and only the chunk's own square is masked.
    """
    chunk, heads, dim = q.shape
    length, kv_heads, _ = k.shape
    fold = heads // kv_heads
    # [Hkv, T * fold, D], row t * fold + f: query head kv * fold + f of token t.
    qh = (q * scale).view(chunk, kv_heads, fold, dim).transpose(0, 1).reshape(kv_heads, -1, dim)
    kt = k.permute(1, 2, 0)  # [Hkv, D, L]
    vh = v.transpose(0, 1)  # [Hkv, L, D]
    out = q.new_empty(kv_heads, chunk * fold, dim)
    rows = min(chunk, max(16, MATMUL_SCORE_BYTES // (heads * length * q.element_size())))
    # Within a block of rows, True where a key of the block follows the row's token: every
    # block masks the same pattern over its own tokens, [rows * fold, rows].
    future = torch.ones(rows, rows, dtype=torch.bool, device=q.device).triu_(1)
    future = future.repeat_interleave(fold, dim=0)
    for a in range(0, chunk, rows):
        b = min(chunk, a + rows)
        r = slice(a * fold, b * fold)
        scores = torch.bmm(qh[:, r], kt[:, :, : start_pos + b])  # [Hkv, rows, keys]
        own = future[: (b - a) * fold, : b - a]
        scores[:, :, start_pos + a :].masked_fill_(own, float("-inf"))
        torch.bmm(torch.softmax(scores, dim=-1), vh[:, : start_pos + b], out=out[:, r])
    return out.view(kv_heads, chunk, fold, dim).transpose(0, 1).reshape(chunk, heads, dim)


def paged_prefill_attention_cpu(
    q: Tensor,  # [T, H, D]
    k_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: Tensor,
    block_table: Tensor,  # [max_blocks], covers start_pos + T tokens
    start_pos: int,
    scale: float,
    grouped: bool = False,
) -> Tensor:
    """Same contract as ``paged_prefill_attention_ref``: the chunk's K/V are already cached.
    ``grouped``: as :func:`prefill_attention_cpu`'s."""
    length = start_pos + q.shape[0]
    _, page, kv_heads, head_dim = k_cache.shape
    n = cdiv(length, page)
    if n > block_table.shape[0]:
        raise ValueError(f"{length} tokens exceed block_table capacity {block_table.shape[0]}")
    pages = block_table[:n].long()
    k = k_cache.index_select(0, pages).view(-1, kv_heads, head_dim)[:length]  # [L, Hkv, D]
    v = v_cache.index_select(0, pages).view(-1, kv_heads, head_dim)[:length]
    return prefill_attention_cpu(q, k, v, scale, start_pos, grouped)
