"""The Triton decoder, bit-exact against the original (interpreted on the CPU when no GPU)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

# The interpreter must be chosen before triton is imported; on a CUDA machine run natively.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from edgeinfer.kernels.compression.encoder import compress_tensor
from edgeinfer.kernels.compression.triton_decoder import decode_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)


def _check(original: torch.Tensor, chunk: int) -> None:
    packed = compress_tensor(original, chunk).to(DEVICE)
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weights_and_special_values(dtype: torch.dtype) -> None:
    weights = (torch.randn(700) * 0.02).to(dtype).view(torch.int16)
    specials = torch.tensor([0, -32768, 0x7F80, 0x7FC1, -1, 1, 0x7C00, 0x03FF], dtype=torch.int16)
    _check(torch.cat([weights, specials]).view(dtype).reshape(4, -1), 64)


def test_all_equal_and_single_element() -> None:
    _check(torch.full((129,), 0.5, dtype=torch.bfloat16), 32)
    _check(torch.tensor([-0.0], dtype=torch.float16), 32)
