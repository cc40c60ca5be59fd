"""Bit-exact round trips of the bf16/fp16 codec through both CPU decoders (numba and numpy)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from edgeinfer.kernels.compression.cpu_decoder import BACKENDS, Backend, decode_cpu, decode_many_cpu
from edgeinfer.kernels.compression.encoder import compress_tensor
from edgeinfer.kernels.compression.errors import CompressionError
from edgeinfer.kernels.compression.format import MAX_EXTRA_BITS
from edgeinfer.kernels.compression.huffman import MAX_CODE_LEN, code_lengths
from edgeinfer.kernels.compression.palette import BLOCK_SIZES, MAX_PALETTE

DTYPES = [torch.bfloat16, torch.float16]
pytest.importorskip("numba")  # both backends are compared; numba is a project dependency


def _words(tensor: torch.Tensor) -> list[int]:
    return tensor.contiguous().view(torch.int16).reshape(-1).tolist()


def _roundtrip(words: list[int], dtype: torch.dtype, chunk: int) -> bool:
    """Check both backends; returns whether the encoder chose palette mode."""
    original = torch.tensor(words, dtype=torch.int32).to(torch.int16).view(dtype)
    packed = compress_tensor(original, chunk)
    for backend in BACKENDS:
        restored = decode_cpu(packed, backend)
        assert restored.dtype == dtype and restored.shape == original.shape
        assert _words(restored) == _words(original), backend
    return packed.palette is not None


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=60, deadline=None)
@given(
    words=st.lists(st.integers(0, 0xFFFF), min_size=0, max_size=600),
    chunk=st.sampled_from([1, 3, 4, 7, 64, 1024]),
)
def test_any_bit_pattern_roundtrips(dtype: torch.dtype, words: list[int], chunk: int) -> None:
    _roundtrip(words, dtype, chunk)


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=30, deadline=None)
@given(
    exponents=st.lists(st.integers(0, 40), min_size=1, max_size=3000),
    seed=st.integers(0, 2**16),
)
def test_skewed_exponents_roundtrip(dtype: torch.dtype, exponents: list[int], seed: int) -> None:
    # Geometric-like exponent spread: long codewords and windows holding < 4 symbols.
    rng = np.random.default_rng(seed)
    high = (np.array(exponents) ** 2 % 256).astype(np.int64)
    words = ((high << 8) | rng.integers(0, 256, len(high))).tolist()
    _roundtrip(words, dtype, 16)


SPECIALS = [
    0x0000,
    0x8000,  # signed zeros
    0x7F80,
    0xFF80,
    0x7C00,
    0xFC00,  # bf16 / fp16 infinities
    0x7FC1,
    0xFFFF,
    0x7F81,
    0x7E01,  # NaNs with payloads
    0x0001,
    0x8001,
    0x03FF,
    0x007F,  # subnormals
]


@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values_roundtrip(dtype: torch.dtype) -> None:
    _roundtrip(SPECIALS * 37, dtype, 64)
    _roundtrip(list(range(0, 0x10000, 7)) + SPECIALS, dtype, 64)  # plain mode


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (), (3, 5, 7), (0,), (2, 0, 3), (4097,)])
def test_shapes_roundtrip(backend: Backend, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    original = torch.randn(shape).to(dtype)
    restored = decode_cpu(compress_tensor(original, 64), backend)
    assert restored.shape == original.shape and _words(restored) == _words(original)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_equal_tensor_is_one_palette_word_per_block(
    backend: Backend, dtype: torch.dtype
) -> None:
    original = torch.full((10_000,), -2.5, dtype=dtype)
    packed = compress_tensor(original)
    assert packed.palette is not None and packed.palette.width == 0  # no index bits at all
    assert packed.bits.numel() == 8  # only the read padding: the exponent takes 0 bits
    assert packed.nbytes < 10_000 / 20
    assert _words(decode_cpu(packed, backend)) == _words(original)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_input_roundtrips(backend: Backend) -> None:
    original = torch.randn(64, 48).to(torch.bfloat16).t()
    assert _words(decode_cpu(compress_tensor(original), backend)) == _words(original)


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_of_mixed_tensors_decodes_in_order(backend: Backend) -> None:
    tensors = [
        torch.randn(5000).to(torch.bfloat16),
        torch.full((3,), 1.0, dtype=torch.float16),
        torch.randn(17, 33).to(torch.float16) * 1e-6,
        torch.randn(1).to(torch.bfloat16),
        _group_quantized(4099, 32, levels=16),
    ]
    chunks = [256, 256, 8, 256, 64]
    packed = [compress_tensor(t, chunk) for t, chunk in zip(tensors, chunks)]
    assert packed[-1].palette is not None
    for original, restored in zip(tensors, decode_many_cpu(packed, backend), strict=True):
        assert _words(restored) == _words(original)


def _group_quantized(n: int, group: int, levels: int, seed: int = 0) -> torch.Tensor:
    """What dequantizing a group-quantized checkpoint gives: ``levels`` values per group."""
    gen = torch.Generator().manual_seed(seed)
    groups = -(-n // group)
    scale = torch.rand(groups, 1, generator=gen) * 0.01
    low = -torch.rand(groups, 1, generator=gen) * 0.05
    q = torch.randint(0, levels, (groups, group), generator=gen)
    return (low + scale * q).reshape(-1)[:n].to(torch.bfloat16)


@pytest.mark.parametrize("group", BLOCK_SIZES)
def test_group_quantized_weights_take_palette_mode(group: int) -> None:
    original = _group_quantized(64 * 1024 + 5, group, levels=16)
    packed = compress_tensor(original)
    assert packed.palette is not None and packed.palette.block == group
    assert packed.palette.width == 4
    # 4 index bits + a palette word per 2 elements at worst (group 32): well under plain's ~66%.
    assert packed.nbytes / (original.numel() * 2) < 0.6
    for backend in BACKENDS:
        assert _words(decode_cpu(packed, backend)) == _words(original)


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=40, deadline=None)
@given(
    alphabet=st.lists(st.integers(0, 0xFFFF), min_size=1, max_size=MAX_PALETTE + 4),
    picks=st.lists(st.integers(0, 2**16), min_size=1, max_size=700),
    chunk=st.sampled_from([1, 5, 64, 1024]),
)
def test_few_distinct_words_roundtrip(
    dtype: torch.dtype, alphabet: list[int], picks: list[int], chunk: int
) -> None:
    # Any words (NaN payloads included) from a small alphabet: palette mode with every index
    # width, blocks cut short at the end, and plain mode past MAX_PALETTE words per block.
    _roundtrip([alphabet[p % len(alphabet)] for p in picks], dtype, chunk)


def test_special_values_take_palette_mode_exactly() -> None:
    assert _roundtrip(SPECIALS * 37, torch.bfloat16, 64)


def test_trained_like_weights_shrink_by_a_third() -> None:
    original = (torch.randn(256, 512) * 0.02).to(torch.bfloat16)
    packed = compress_tensor(original)
    assert packed.palette is None  # ~32 distinct words per 32: a palette would only cost more
    # Top mantissa bits are skewed within a binade: coding them with the exponent pays.
    assert packed.extra_bits > 0
    assert packed.nbytes < compress_tensor(original, extra_bits=0).nbytes
    assert packed.nbytes / (original.numel() * 2) < 0.66


@pytest.mark.parametrize("extra_bits", range(MAX_EXTRA_BITS + 1))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk", [1, 7, 64, 1024])
def test_every_extra_bits_roundtrips(extra_bits: int, dtype: torch.dtype, chunk: int) -> None:
    # 230 words: under the 256 symbols a code may hold, whatever the extra bits.
    weights = _words((torch.randn(201) * 0.02).to(dtype))
    for words in (weights + SPECIALS, weights * 5 + SPECIALS, [0x3F80] * 65, [0x8000]):
        original = torch.tensor(words, dtype=torch.int32).to(torch.int16).view(dtype)
        packed = compress_tensor(original, chunk, extra_bits=extra_bits)
        assert packed.extra_bits == extra_bits
        for backend in BACKENDS:
            assert _words(decode_cpu(packed, backend)) == _words(original), backend


def test_extra_bits_beyond_the_symbol_limit_are_refused() -> None:
    # 4096 distinct words: 2048 distinct 11-bit symbols, more than a code may hold.
    original = torch.arange(4096, dtype=torch.int32).mul(16).to(torch.int16)
    with pytest.raises(CompressionError, match="distinct symbols"):
        compress_tensor(original.view(torch.bfloat16), extra_bits=3)


def test_float32_is_rejected() -> None:
    with pytest.raises(CompressionError, match="float32"):
        compress_tensor(torch.zeros(4))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 2**40), min_size=256, max_size=256))
def test_code_lengths_are_limited_and_complete(counts: list[int]) -> None:
    lengths = code_lengths(np.array(counts, dtype=np.int64))
    used = lengths[np.array(counts) > 0].astype(np.int64)
    assert lengths.max() <= MAX_CODE_LEN
    if len(used) > 1:
        assert np.sum(2.0**-used) == pytest.approx(1.0)
