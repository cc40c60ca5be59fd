"""Paged attention over the engine's block KV cache.

Cache layout (per layer): ``k_cache``/``v_cache`` are ``[num_blocks, block_size, Hkv, D]``;
token ``p`` of a sequence lives in block ``block_table[p // block_size]`` at slot
``p % block_size``. Query head ``h`` reads kv head ``h // (H // Hkv)`` (GQA).

The torch references are also the CPU production path; the Triton decode kernel (CUDA path) is
CUDA-graph safe: its grid and loop bounds come only from shapes or device tensors."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from edgeinfer.kernels.paged_attention_cpu import paged_decode_attention_cpu
from edgeinfer.kernels.triton_utils import cdiv, has_triton, split_k_factor, triton_available

_HALF = (torch.float16, torch.bfloat16)
_SUPPORTED = (torch.float32, *_HALF)


def _check_cache(q: Tensor, k_cache: Tensor, v_cache: Tensor, q_layout: str) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be {q_layout}, got shape {tuple(q.shape)}")
    shapes = (tuple(k_cache.shape), tuple(v_cache.shape))
    if k_cache.dim() != 4 or shapes[0] != shapes[1]:
        raise ValueError(f"k_cache/v_cache must both be [blocks, block_size, Hkv, D], got {shapes}")
    if k_cache.shape[3] != q.shape[2] or q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(f"q {tuple(q.shape)} needs D == cache D and H divisible by Hkv: {shapes}")
    dtypes = (q.dtype, k_cache.dtype, v_cache.dtype)
    if q.dtype not in _SUPPORTED or len(set(dtypes)) != 1:
        raise ValueError(f"q/k_cache/v_cache need one dtype of {_SUPPORTED}, got {dtypes}")


def _check_decode(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, context_lens: Tensor
) -> None:
    _check_cache(q, k_cache, v_cache, "[B, H, D]")
    batch, table = q.shape[0], tuple(block_tables.shape)
    if block_tables.dim() != 2 or table[0] != batch:
        raise ValueError(f"block_tables must be [{batch}, max_blocks], got {table}")
    if context_lens.shape != (batch,):
        raise ValueError(f"context_lens must be [{batch}], got {tuple(context_lens.shape)}")
    if block_tables.is_floating_point() or context_lens.is_floating_point():
        raise ValueError("block_tables and context_lens must be integer tensors")


def _gather(cache: Tensor, pages: Tensor) -> Tensor:
    """cache[pages] as a contiguous [P, block_size, Hkv, D]. index_select is ~5x faster than
    advanced indexing on CPU. CPU half SDPA is slower and less accurate than fp32, so half
    caches are upcast here, while contiguous: upcasting after the head transpose is ~10x slower."""
    pages_kv = cache.index_select(0, pages)
    return pages_kv.float() if cache.device.type == "cpu" and cache.dtype in _HALF else pages_kv


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """SDPA over q [N, H, Lq, D] and k/v [N, Hkv, Lk, D] from `_gather` (maybe upcast), with a
    boolean mask broadcastable to [N, H, Lq, Lk]."""
    gqa = q.shape[1] != k.shape[1]
    q = q.to(k.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def paged_decode_attention_ref(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
) -> Tensor:
    """Decode attention in torch: q [B, H, D] (one new token per sequence, K/V already cached),
    block_tables [B, max_blocks], context_lens [B] (cached tokens incl. the new one; 0 gives a
    zero output row). Returns [B, H, D] in q's dtype. Syncs with the device once (max length)."""
    _check_decode(q, k_cache, v_cache, block_tables, context_lens)
    batch, _, head_dim = q.shape
    _, page, kv_heads, _ = k_cache.shape
    if batch == 0:
        return torch.empty_like(q)
    # Gather only up to the longest sequence, not the table's full width.
    max_len = int(context_lens.max())
    if max_len > block_tables.shape[1] * page:
        raise ValueError(f"context length {max_len} exceeds block_tables capacity")
    n_blocks = max(1, cdiv(max_len, page))
    pages = block_tables[:, :n_blocks].reshape(-1).long()  # [B * nb]
    # One gather per cache: [B * nb, page, Hkv, D] -> [B, Hkv, nb * page, D] (strided view;
    # SDPA takes it as is, a contiguous copy costs more than it saves).
    k = _gather(k_cache, pages).view(batch, -1, kv_heads, head_dim).transpose(1, 2)
    v = _gather(v_cache, pages).view(batch, -1, kv_heads, head_dim).transpose(1, 2)
    lens = context_lens.to(q.device, torch.int64)
    positions = torch.arange(n_blocks * page, device=q.device)
    # Clamp so empty rows keep one visible key (SDPA would return NaN); they are zeroed below.
    mask = positions[None, :] < lens.clamp(min=1)[:, None]  # [B, L]
    out = _sdpa(q.unsqueeze(2), k, v, mask[:, None, None, :], scale).squeeze(2)  # [B, H, D]
    out = out.masked_fill((lens == 0)[:, None, None], 0.0)
    return out.to(q.dtype)


def paged_prefill_attention_ref(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, start_pos: int, scale: float
) -> Tensor:
    """Causal attention for one sequence's chunk: q [T, H, D] holds positions
    start_pos .. start_pos+T-1 (their K/V already cached) and attends to cached positions
    0 .. start_pos+T-1 via block_table [max_blocks]. Returns [T, H, D] in q's dtype."""
    _check_cache(q, k_cache, v_cache, "[T, H, D]")
    if block_table.dim() != 1 or block_table.is_floating_point():
        raise ValueError(f"block_table must be an integer [max_blocks], got {block_table.shape}")
    if start_pos < 0:
        raise ValueError(f"start_pos must be >= 0, got {start_pos}")
    chunk, _, head_dim = q.shape
    _, page, kv_heads, _ = k_cache.shape
    total = start_pos + chunk
    n_blocks = cdiv(total, page)
    if n_blocks > block_table.shape[0]:
        raise ValueError(f"{total} tokens exceed block_table capacity {block_table.shape[0]}")
    if chunk == 0:
        return torch.empty_like(q)
    pages = block_table[:n_blocks].long()
    k = _gather(k_cache, pages).view(-1, kv_heads, head_dim)[:total]  # [L, Hkv, D]
    v = _gather(v_cache, pages).view(-1, kv_heads, head_dim)[:total]
    key_pos = torch.arange(total, device=q.device)
    query_pos = key_pos[start_pos:]  # [T]
    mask = key_pos[None, :] <= query_pos[:, None]  # [T, L] causal over absolute positions
    # Heads-first views: q [1, H, T, D], k/v [1, Hkv, L, D].
    q4, k4, v4 = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    return _sdpa(q4, k4, v4, mask, scale)[0].transpose(0, 1).to(q.dtype)  # [T, H, D]


if has_triton():
    import triton
    import triton.language as tl

    @triton.jit
    def _decode_kernel(
        q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, m_ptr, l_ptr,
        scale_log2, part_len,
        stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        stride_bt, stride_ob, stride_oh, stride_os,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
    ):  # fmt: skip
        # One program per (sequence, kv head, split): all GROUP query heads sharing the kv head
        # are one [BLOCK_G, BLOCK_D] tile, so each K/V element is read once per split.
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        ctx = tl.load(lens_ptr + b)
        start = split * part_len
        end = tl.minimum(ctx, start + part_len)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        heads = kvh * GROUP + offs_g
        gd_mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=gd_mask, other=0.0).to(DOT_DTYPE)  # [BLOCK_G, BLOCK_D]  # fmt: skip
        # Finite floor: a split with no tokens keeps m at -1e30 instead of -inf, so
        # exp2(m_old - m_new) never becomes exp2(-inf + inf) = NaN.
        m_i = tl.full([BLOCK_G], -1e30, tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        # Loop bounds come from device memory: no host sync, graph-capturable.
        for n0 in range(start, end, BLOCK_N):
            n = n0 + offs_n  # [BLOCK_N] token positions
            n_mask = n < end
            page = tl.load(bt_ptr + b * stride_bt + n // PAGE, mask=n_mask, other=0).to(tl.int64)
            slot = n % PAGE
            k_off = page * stride_kb + slot * stride_ks + kvh * stride_kh  # [BLOCK_N]
            v_off = page * stride_vb + slot * stride_vs + kvh * stride_vh
            nd_mask = n_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
            k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :], mask=nd_mask, other=0.0)
            k = k.to(DOT_DTYPE)  # [BLOCK_N, BLOCK_D]
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2  # [BLOCK_G, BLOCK_N]
            qk = tl.where(n_mask[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=nd_mask, other=0.0)
            v = v.to(DOT_DTYPE)
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PREC)
            m_i = m_new
        o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        if NUM_SPLITS == 1:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # ctx == 0: acc is 0 -> zeros
            tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=gd_mask)
        else:
            # Unnormalised partials; _combine_kernel merges splits with their (m, l) stats.
            tl.store(o_ptrs + split * stride_os, acc, mask=gd_mask)
            ml_off = (b * GROUP * tl.num_programs(1) + heads) * NUM_SPLITS + split
            tl.store(m_ptr + ml_off, m_i, mask=offs_g < GROUP)
            tl.store(l_ptr + ml_off, l_i, mask=offs_g < GROUP)

    @triton.jit
    def _combine_kernel(
        part_ptr, m_ptr, l_ptr, out_ptr, stride_ob, stride_oh,
        HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
        BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        # One program per (sequence, query head); partials are [B, H, NUM_SPLITS, HEAD_DIM].
        b = tl.program_id(0)
        h = tl.program_id(1)
        row = b * tl.num_programs(1) + h
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        s_mask = offs_s < NUM_SPLITS
        m = tl.load(m_ptr + row * NUM_SPLITS + offs_s, mask=s_mask, other=-1e30)  # [BLOCK_S]
        sums = tl.load(l_ptr + row * NUM_SPLITS + offs_s, mask=s_mask, other=0.0)
        sd_mask = s_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
        part = tl.load(part_ptr + (row * NUM_SPLITS + offs_s[:, None]) * HEAD_DIM + offs_d[None, :],
                       mask=sd_mask, other=0.0)  # [BLOCK_S, BLOCK_D]  # fmt: skip
        w = tl.exp2(m - tl.max(m, 0))  # rescale every split to the global max
        denom = tl.sum(w * sums, 0)
        out = tl.sum(part * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
        tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
                 mask=offs_d < HEAD_DIM)  # fmt: skip


def paged_decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    out: Tensor | None = None,
    num_splits: int | None = None,
) -> Tensor:
    """Triton decode attention; same contract as `paged_decode_attention_ref`. Writes into
    `out` [B, H, D] when given (for CUDA graphs). num_splits > 1 selects flash-decoding (split
    the context, then merge); by default it is chosen from shapes, never from data."""
    if not has_triton():
        raise RuntimeError("paged_decode_attention needs triton; use decode_attention instead")
    _check_decode(q, k_cache, v_cache, block_tables, context_lens)
    batch, heads, head_dim = q.shape
    _, page, kv_heads, _ = k_cache.shape
    if head_dim > 256 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError(f"Triton path needs head_dim <= 256 (got {head_dim}), caches dense in D")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be a {tuple(q.shape)} {q.dtype} tensor contiguous in head_dim")
    if batch == 0:
        return out
    q = q if q.stride(2) == 1 else q.contiguous()
    group = heads // kv_heads
    max_len = block_tables.shape[1] * page
    if num_splits is None:
        num_splits = split_k_factor(batch * kv_heads, max_len, q.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    # tl.dot needs every dim >= 16 on GPU: pad head_dim and the GQA group (rows) up to 16.
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n = 64 if block_d <= 128 else 32  # tokens per step; smaller tiles for wide heads
    part_len = cdiv(cdiv(max_len, num_splits), block_n) * block_n  # multiple of block_n
    num_splits = cdiv(max_len, part_len)
    # Native-dtype tensor-core dots on GPU; fp32 under the CPU interpreter, whose tl.dot
    # multiplies the raw uint16 bits of bf16 operands.
    dot_dtype = getattr(tl, str(q.dtype).removeprefix("torch.")) if q.is_cuda else tl.float32
    if num_splits == 1:
        dst, maxes, sums, stride_os = out, out, out, 0
    else:
        dst = torch.empty(batch, heads, num_splits, head_dim, device=q.device, dtype=torch.float32)
        maxes = torch.empty(batch, heads, num_splits, device=q.device, dtype=torch.float32)
        sums = torch.empty_like(maxes)
        stride_os = dst.stride(2)
    _decode_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, dst, maxes, sums,
        scale * 1.4426950408889634, part_len,  # log2(e): the kernel uses exp2
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0), dst.stride(0), dst.stride(1), stride_os,
        GROUP=group, HEAD_DIM=head_dim, PAGE=page, NUM_SPLITS=num_splits,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=block_n,
        DOT_DTYPE=dot_dtype, DOT_PREC="ieee" if dot_dtype == tl.float32 else "tf32",
    )  # fmt: skip
    if num_splits > 1:
        _combine_kernel[(batch, heads)](
            dst, maxes, sums, out, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
        )  # fmt: skip
    return out


def decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    out: Tensor | None = None,
) -> Tensor:
    """Engine entry point: the Triton kernel for CUDA tensors when triton is usable, the
    per-sequence torch path on the CPU, else the batched torch reference. Returns `out` when
    it is given."""
    if q.is_cuda and triton_available():
        return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, out)
    if q.device.type == "cpu":
        result = paged_decode_attention_cpu(q, k_cache, v_cache, block_tables, context_lens, scale)
    else:
        result = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale)
    return result if out is None else out.copy_(result)
