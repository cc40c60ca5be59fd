"""The Triton decoder, bit-exact against the original (interpreted on the CPU when no GPU)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

# conftest.py chooses the interpreter without a GPU, before triton is first imported.
pytest.importorskip("triton")

from edgeinfer.kernels.compression.encoder import compress_tensor
from edgeinfer.kernels.compression.triton_decoder import decode_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)


def _check(original: torch.Tensor, chunk: int, extra_bits: int | None = None) -> None:
    packed = compress_tensor(original, chunk, extra_bits=extra_bits).to(DEVICE)
    restored = decode_triton(packed).cpu()
    assert restored.dtype == original.dtype and restored.shape == original.shape
    assert torch.equal(restored.view(torch.int16), original.view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@settings(max_examples=12, deadline=None)
@given(
    words=st.lists(st.integers(0, 0xFFFF), min_size=1, max_size=300),
    chunk=st.sampled_from([1, 5, 32]),
)
def test_any_bit_pattern_roundtrips(dtype: torch.dtype, words: list[int], chunk: int) -> None:
    original = torch.tensor(words, dtype=torch.int32).to(torch.int16).view(dtype)
    _check(original, chunk)


@pytest.mark.parametrize("extra_bits", [None, 0, 1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weights_and_special_values(dtype: torch.dtype, extra_bits: int | None) -> None:
    # None: the encoder's choice; 0 is the format-1 stream, 1-3 the extended ones. 248 words
    # stay under the 256 symbols a code may hold.
    weights = (torch.randn(240) * 0.02).to(dtype).view(torch.int16)
    specials = torch.tensor([0, -32768, 0x7F80, 0x7FC1, -1, 1, 0x7C00, 0x03FF], dtype=torch.int16)
    _check(torch.cat([weights, specials]).view(dtype).reshape(4, -1), 64, extra_bits)


@pytest.mark.parametrize("extra_bits", [None, 0, 3])
def test_all_equal_and_single_element(extra_bits: int | None) -> None:
    _check(torch.full((129,), 0.5, dtype=torch.bfloat16), 32, extra_bits)
    _check(torch.tensor([-0.0], dtype=torch.float16), 32, extra_bits)
    _check(torch.tensor([float("nan")], dtype=torch.bfloat16), 5, extra_bits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@settings(max_examples=6, deadline=None)
@given(
    alphabet=st.lists(st.integers(0, 0xFFFF), min_size=1, max_size=16),
    picks=st.lists(st.integers(0, 2**16), min_size=1, max_size=300),
)
def test_palette_mode_roundtrips(dtype: torch.dtype, alphabet: list[int], picks: list[int]) -> None:
    words = [alphabet[p % len(alphabet)] for p in picks]
    # Palette mode wherever it is smaller than plain mode: all but the shortest tensors.
    original = torch.tensor(words, dtype=torch.int32).to(torch.int16).view(dtype)
    _check(original, 32)


def test_group_quantized_weights() -> None:
    gen = torch.Generator().manual_seed(0)
    scale, low = torch.rand(40, 1, generator=gen) * 0.01, -torch.rand(40, 1, generator=gen) * 0.05
    q = torch.randint(0, 16, (40, 64), generator=gen)
    original = (low + scale * q).to(torch.bfloat16).reshape(-1)[:2555].reshape(5, 511)
    assert compress_tensor(original).palette is not None
    _check(original, 64)
