"""Paged attention (torch references and Triton decode kernel) against a naive float64 oracle.

Triton tests run on CUDA, or on CPU tensors under TRITON_INTERPRET=1 (the Makefile sets it);
otherwise they skip.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from edgeinfer.kernels import paged_attention_cpu
from edgeinfer.kernels.paged_attention import (
    decode_attention,
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
)
from edgeinfer.kernels.paged_attention_cpu import (
    paged_decode_attention_cpu,
    paged_prefill_attention_cpu,
    plan_decode_cpu,
)
from edgeinfer.kernels.paged_attention_numba import paged_decode_attention_numba, supports
from edgeinfer.kernels.triton_utils import triton_available, triton_interpret

DEVICE = "cuda" if torch.cuda.is_available() and not triton_interpret() else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
LENGTHS = [1, 15, 16, 17, 100, 33]
needs_triton = pytest.mark.skipif(
    not triton_available(), reason="triton not importable, or no CUDA and TRITON_INTERPRET!=1"
)


def make_cache(lengths, kv_heads, head_dim, page, dtype, device="cpu", seed=0):
    """Random K/V cache whose sequences own shuffled, non-contiguous blocks; padding entries
    of the block table point at block 0 (which also holds live data)."""
    gen = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / page) for n in lengths]
    num_blocks = sum(need) + 3
    shape = (num_blocks, page, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(device, dtype)
    v_cache = torch.randn(shape, generator=gen).to(device, dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(lengths), max(need) + 2, dtype=torch.int32)
    for row, count in enumerate(need):
        tables[row, :count] = torch.tensor([order.pop() for _ in range(count)])
    lens = torch.tensor(lengths, dtype=torch.int32)
    return k_cache, v_cache, tables.to(device), lens.to(device)


def naive_attention(q, k_cache, v_cache, table, length, query_pos, scale):
    """float64 attention of queries q [T, H, D] at absolute positions query_pos [T] over the
    first `length` cached tokens of one sequence, one head at a time."""
    page, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kv_heads
    pos = torch.arange(length)
    blocks = table.cpu().long()[pos // page]
    k = k_cache.cpu().double()[blocks, pos % page]  # [L, Hkv, D]
    v = v_cache.cpu().double()[blocks, pos % page]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for h in range(q.shape[1]):
        scores = q[:, h].cpu().double() @ k[:, h // group].T * scale  # [T, L]
        scores[pos[None, :] > query_pos[:, None]] = float("-inf")
        out[:, h] = torch.softmax(scores, dim=-1) @ v[:, h // group]
    return out


def naive_decode(q, k_cache, v_cache, tables, lens, scale):
    rows = []
    for b, n in enumerate(lens.tolist()):
        if n == 0:
            rows.append(torch.zeros(q.shape[1:], dtype=torch.float64))
            continue
        qpos = torch.tensor([n - 1])
        rows.append(naive_attention(q[b : b + 1], k_cache, v_cache, tables[b], n, qpos, scale)[0])
    return torch.stack(rows)


def check(actual, expected, dtype):
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.cpu().double(), expected, atol=TOL[dtype], rtol=TOL[dtype])


TORCH_DECODERS = {"batched": paged_decode_attention_ref, "per-seq-cpu": paged_decode_attention_cpu}


@pytest.mark.parametrize("impl", list(TORCH_DECODERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("page", [16, 8])
def test_decode_ref_matches_naive(impl, dtype, group, page):
    k_cache, v_cache, tables, lens = make_cache(LENGTHS, 2, 32, page, dtype)
    q = torch.randn(len(LENGTHS), 2 * group, 32).to(dtype)
    out = TORCH_DECODERS[impl](q, k_cache, v_cache, tables, lens, 0.125)
    check(out, naive_decode(q, k_cache, v_cache, tables, lens, 0.125), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("page", [16, 8])
def test_numba_decode_matches_naive(group, page, dtype):
    k_cache, v_cache, tables, lens = make_cache(LENGTHS, 2, 32, page, dtype)
    lens[2] = 0  # a row without context gives zeros
    q = torch.randn(len(LENGTHS), 2 * group, 32).to(dtype)
    out = paged_decode_attention_numba(q, k_cache, v_cache, tables, lens, 0.125)
    check(out, naive_decode(q, k_cache, v_cache, tables, lens, 0.125), dtype)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    # Into a caller's buffer, from a strided view of q (the engine's q is a slice of q|k|v).
    qkv = torch.randn(len(LENGTHS), 2 * group + 4, 32).to(dtype)
    dest = torch.full_like(q, float("nan"))
    paged_decode_attention_numba(qkv[:, : 2 * group], k_cache, v_cache, tables, lens, 0.5, dest)
    check(dest, naive_decode(qkv[:, : 2 * group], k_cache, v_cache, tables, lens, 0.5), dtype)


def test_numba_decode_reads_bf16_pages_exactly():
    # bf16 values widen to float32 without rounding: the same pages in float32 give the same
    # float32 result, which the wrapper then rounds once to bf16.
    k_cache, v_cache, tables, lens = make_cache(LENGTHS, 2, 32, 16, torch.bfloat16)
    q = torch.randn(len(LENGTHS), 4, 32).to(torch.bfloat16)
    out = paged_decode_attention_numba(q, k_cache, v_cache, tables, lens, 0.125)
    wide = paged_decode_attention_numba(
        q.float(), k_cache.float(), v_cache.float(), tables, lens, 0.125
    )
    assert torch.equal(out, wide.to(torch.bfloat16))


def test_numba_decode_rejects_what_it_cannot_take():
    k_cache, v_cache, tables, lens = make_cache([5, 20], 2, 16, 16, torch.float16)
    q = torch.randn(2, 4, 16, dtype=torch.float16)
    assert not supports(q, k_cache)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        paged_decode_attention_numba(q, k_cache, v_cache, tables, lens, 0.25)
    k_cache, v_cache = k_cache.float(), v_cache.float()
    with pytest.raises(ValueError, match="divide"):
        paged_decode_attention_numba(torch.randn(2, 3, 16), k_cache, v_cache, tables, lens, 0.25)
    with pytest.raises(ValueError, match="block table"):
        paged_decode_attention_numba(torch.randn(2, 4, 16), k_cache, v_cache, tables[:, :1],
                                     torch.tensor([5, 20]), 0.25)  # fmt: skip


@pytest.mark.parametrize("impl", list(TORCH_DECODERS))
def test_decode_ref_zero_length_row_is_zero(impl):
    k_cache, v_cache, tables, lens = make_cache([5, 20], 2, 16, 16, torch.float32)
    lens[0] = 0
    q = torch.randn(2, 4, 16)
    out = TORCH_DECODERS[impl](q, k_cache, v_cache, tables, lens, 0.25)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    check(out, naive_decode(q, k_cache, v_cache, tables, lens, 0.25), torch.float32)


def test_cpu_decode_plan_groups_and_reuse():
    # Unsorted lengths in several groups (rows out of order), a shared plan, host-list input.
    lengths = [700, 3, 40, 650, 41, 1, 300, 16, 17, 690]
    k_cache, v_cache, tables, lens = make_cache(lengths, 2, 16, 16, torch.float32)
    q = torch.randn(len(lengths), 6, 16)
    expected = naive_decode(q, k_cache, v_cache, tables, lens, 0.25)
    plan = plan_decode_cpu(tables, lens, 16, key_bytes=256)
    assert len(plan.groups) > 1
    assert any(not isinstance(g.rows, slice) for g in plan.groups)
    from_lists = plan_decode_cpu(tables.tolist(), lengths, 16, key_bytes=256)
    for p in (plan, from_lists, plan):
        out = torch.full_like(q, float("nan"))
        paged_decode_attention_cpu(q, k_cache, v_cache, tables, lens, 0.25, p, out)
        check(out, expected, torch.float32)


def test_cpu_decode_plan_sorted_rows_are_slices():
    # Rows in ascending length order (as the engine's runner sends them) need no row copies;
    # host tables may be ragged (each row only its own blocks).
    lengths = [5, 16, 17, 90, 100]
    k_cache, v_cache, tables, lens = make_cache(lengths, 1, 16, 8, torch.float32)
    ragged = [row[: -(-n // 8)] for row, n in zip(tables.tolist(), lengths)]
    plan = plan_decode_cpu(ragged, lengths, 8, key_bytes=128)
    assert all(isinstance(g.rows, slice) for g in plan.groups)
    q = torch.randn(len(lengths), 3, 16)
    out = paged_decode_attention_cpu(q, k_cache, v_cache, tables, lens, 0.5, plan)
    check(out, naive_decode(q, k_cache, v_cache, tables, lens, 0.5), torch.float32)
    with pytest.raises(ValueError, match="plan"):
        paged_decode_attention_cpu(q[:2], k_cache, v_cache, tables, lens, 0.5, plan)


PREFILLS = {
    "ref": paged_prefill_attention_ref,
    "cpu": paged_prefill_attention_cpu,
    # A KV head's query heads as rows of one matrix after a prefix (heads repeated before it).
    "cpu_grouped": functools.partial(paged_prefill_attention_cpu, grouped=True),
}


@pytest.mark.parametrize("impl", list(PREFILLS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("start", "chunk"), [(0, 20), (17, 5), (32, 16), (40, 1)])
def test_prefill_ref_matches_naive(impl, dtype, start, chunk):
    k_cache, v_cache, tables, _ = make_cache([start + chunk], 2, 32, 16, dtype)
    q = torch.randn(chunk, 8, 32).to(dtype)
    out = PREFILLS[impl](q, k_cache, v_cache, tables[0], start, 0.2)
    qpos = torch.arange(start, start + chunk)
    expected = naive_attention(q, k_cache, v_cache, tables[0], start + chunk, qpos, 0.2)
    check(out, expected, dtype)


def test_prefill_last_token_equals_decode():
    k_cache, v_cache, tables, lens = make_cache([37], 2, 32, 16, torch.float32)
    q = torch.randn(1, 4, 32)
    prefill = paged_prefill_attention_ref(q, k_cache, v_cache, tables[0], 36, 0.3)
    decode = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.3)
    torch.testing.assert_close(prefill, decode)


def test_dispatcher_writes_out_on_cpu():
    k_cache, v_cache, tables, lens = make_cache([3, 18], 1, 16, 16, torch.float32)
    q = torch.randn(2, 2, 16)
    out = torch.empty_like(q)
    result = decode_attention(q, k_cache, v_cache, tables, lens, 0.25, out=out)
    assert result is out
    check(out, naive_decode(q, k_cache, v_cache, tables, lens, 0.25), torch.float32)


def test_invalid_inputs_raise_value_error():
    k_cache, v_cache, tables, lens = make_cache([4], 2, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="divisible"):
        paged_decode_attention_ref(torch.randn(1, 3, 16), k_cache, v_cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="integer"):
        paged_decode_attention_ref(torch.randn(1, 2, 16), k_cache, v_cache, tables.float(), lens, 1)
    with pytest.raises(ValueError, match="capacity"):
        paged_prefill_attention_ref(torch.randn(4, 2, 16), k_cache, v_cache, tables[0], 60, 1.0)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("splits", [1, 3])
def test_triton_decode_matches_naive(dtype, group, splits):
    lengths = [1, 15, 16, 17, 100, 0]
    k_cache, v_cache, tables, lens = make_cache(lengths, 2, 32, 16, dtype, DEVICE)
    q = torch.randn(len(lengths), 2 * group, 32).to(DEVICE, dtype)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, num_splits=splits)
    check(out, naive_decode(q, k_cache, v_cache, tables, lens, 0.125), dtype)


@needs_triton
@pytest.mark.parametrize(("page", "head_dim"), [(8, 40), (32, 16), (16, 64)])
def test_triton_decode_odd_shapes_and_out(page, head_dim):
    # Non-power-of-two head_dim is masked; pages smaller or larger than the token tile work.
    lengths = [70, 9, 33]
    k_cache, v_cache, tables, lens = make_cache(lengths, 1, head_dim, page, torch.float32, DEVICE)
    q = torch.randn(3, 4, head_dim, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    result = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1, out=out)
    assert result is out
    check(out, naive_decode(q, k_cache, v_cache, tables, lens, 0.1), torch.float32)


@needs_triton
def test_triton_default_splits_long_context():
    # Few programs over a long table: the default picks flash-decoding (several splits).
    k_cache, v_cache, tables, lens = make_cache([600, 260], 1, 32, 16, torch.bfloat16, DEVICE)
    q = torch.randn(2, 4, 32).to(DEVICE, torch.bfloat16)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.2)
    check(out, naive_decode(q, k_cache, v_cache, tables, lens, 0.2), torch.bfloat16)


@pytest.mark.parametrize(("start", "chunk", "block_bytes"), [(0, 40, 1 << 20), (37, 21, 2048)])
def test_bf16_prefill_matmuls_match_naive(monkeypatch, start, chunk, block_bytes):
    # The bf16 matmul path (CPUs with bf16 dot products), forced on: after a prefix, from the
    # first token, and in several row blocks (a tiny block budget: 16 rows per block).
    monkeypatch.setattr(paged_attention_cpu, "native_bf16", lambda: True)
    monkeypatch.setattr(paged_attention_cpu, "MATMUL_MIN_CHUNK", 1)
    monkeypatch.setattr(paged_attention_cpu, "MATMUL_SCORE_BYTES", block_bytes)
    k_cache, v_cache, tables, _ = make_cache([start + chunk], 2, 32, 16, torch.bfloat16)
    q = torch.randn(chunk, 6, 32).to(torch.bfloat16)
    out = paged_prefill_attention_cpu(q, k_cache, v_cache, tables[0], start, 0.2)
    qpos = torch.arange(start, start + chunk)
    expected = naive_attention(q, k_cache, v_cache, tables[0], start + chunk, qpos, 0.2)
    check(out, expected, torch.bfloat16)
