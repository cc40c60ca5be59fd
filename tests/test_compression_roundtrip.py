"""Bit-exact round trips of the bf16/fp16 codec through the vectorised CPU decoder."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from edgeinfer.kernels.compression.cpu_decoder import decode_cpu, decode_many_cpu
from edgeinfer.kernels.compression.encoder import compress_tensor
from edgeinfer.kernels.compression.errors import CompressionError
from edgeinfer.kernels.compression.huffman import MAX_CODE_LEN, code_lengths

DTYPES = [torch.bfloat16, torch.float16]


def _words(tensor: torch.Tensor) -> list[int]:
    return tensor.contiguous().view(torch.int16).reshape(-1).tolist()


def _roundtrip(words: list[int], dtype: torch.dtype, chunk: int) -> None:
    original = torch.tensor(words, dtype=torch.int32).to(torch.int16).view(dtype)
    restored = decode_cpu(compress_tensor(original, chunk))
    assert restored.dtype == dtype and restored.shape == original.shape
    assert _words(restored) == _words(original)


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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (), (3, 5, 7), (0,), (2, 0, 3), (4097,)])
def test_shapes_roundtrip(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    original = torch.randn(shape).to(dtype)
    restored = decode_cpu(compress_tensor(original, 64))
    assert restored.shape == original.shape and _words(restored) == _words(original)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_equal_tensor_costs_no_coded_bits(dtype: torch.dtype) -> None:
    original = torch.full((10_000,), -2.5, dtype=dtype)
    packed = compress_tensor(original)
    assert packed.bits.numel() == 8  # only the read padding: the exponent takes 0 bits
    assert _words(decode_cpu(packed)) == _words(original)


def test_non_contiguous_input_roundtrips() -> None:
    original = torch.randn(64, 48).to(torch.bfloat16).t()
    assert _words(decode_cpu(compress_tensor(original))) == _words(original)


def test_batch_of_mixed_tensors_decodes_in_order() -> None:
    tensors = [
        torch.randn(5000).to(torch.bfloat16),
        torch.full((3,), 1.0, dtype=torch.float16),
        torch.randn(17, 33).to(torch.float16) * 1e-6,
        torch.randn(1).to(torch.bfloat16),
    ]
    packed = [compress_tensor(t, chunk) for t, chunk in zip(tensors, [256, 256, 8, 256])]
    for original, restored in zip(tensors, decode_many_cpu(packed), strict=True):
        assert _words(restored) == _words(original)


def test_trained_like_weights_shrink_by_a_third() -> None:
    original = (torch.randn(256, 512) * 0.02).to(torch.bfloat16)
    packed = compress_tensor(original)
    assert packed.nbytes / (original.numel() * 2) < 0.70


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
