"""The compiled pointwise ops of a decoder layer against the torch formulations they replace:
within float32 rounding, and bit for bit in bfloat16 (they round where torch's bf16 ops do)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from edgeinfer.daemon.engine.model import RMSNorm
from edgeinfer.daemon.engine.rope import Rotation, apply_rotary
from edgeinfer.kernels import decoder_pointwise as pw
from native_helpers import require_native


@pytest.fixture(autouse=True)
def _built() -> None:
    require_native("decoder_pointwise")  # skips without a compiler; a failed build fails


DTYPES = [torch.float32, torch.bfloat16]
TOKENS = [1, 7, 300]  # a decode row, a small batch, a prefill chunk (parallel path)


def same(got: torch.Tensor, expected: torch.Tensor, *, exact_bf16: bool = True) -> None:
    if got.dtype == torch.bfloat16 and exact_bf16:
        assert torch.equal(got, expected)
    elif got.dtype == torch.bfloat16:  # exp() of another library: a bf16 step or two apart
        torch.testing.assert_close(got, expected, rtol=2**-6, atol=1e-6)
    else:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def torch_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_rms_norm_and_residual_add(dtype, tokens):
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 576, generator=gen).to(dtype)
    delta = torch.randn(tokens, 576, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(576, generator=gen)).to(dtype)
    same(pw.rms_norm(x, weight, 1e-5), torch_norm(x, weight, 1e-5))
    total, normed = pw.add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(total, x + delta)
    same(normed, torch_norm(x + delta, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_over_heads_of_a_strided_view(dtype):
    # Qwen3's q/k norms: each head's row of a slice of the fused q|k|v projection.
    qkv = torch.randn(5, 12, 64).to(dtype)
    weight = torch.rand(64).to(dtype)
    same(pw.rms_norm(qkv[:, :8], weight, 1e-6), torch_norm(qkv[:, :8], weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_rotate_in_place_matches_apply_rotary(dtype, tokens):
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, 12 + 2 * 4, 64, generator=gen).to(dtype)
    angles = torch.rand(tokens, 32, generator=gen) * 100
    emb = torch.cat((angles, angles), dim=-1)
    rot = Rotation.build(emb.cos(), emb.sin(), dtype)
    expected = apply_rotary(qkv[:, :16], emb.cos(), emb.sin())
    v_before = qkv[:, 16:].clone()
    assert pw.rotate_(qkv[:, :16], rot.cos, rot.signed_sin).data_ptr() == qkv.data_ptr()
    same(qkv[:, :16], expected)
    assert torch.equal(qkv[:, 16:], v_before)  # the values beside q and k are untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_silu_mul(dtype, tokens):
    gate_up = (4 * torch.randn(tokens, 2 * 1536)).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    same(pw.silu_mul(gate_up), F.silu(gate) * up, exact_bf16=False)


def test_the_model_norm_takes_the_compiled_path_with_the_same_result():
    norm = RMSNorm(64, 1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        x, delta = torch.randn(3, 64), torch.randn(3, 64)
        total, normed = norm.add_forward(x, delta)
        torch.testing.assert_close(normed, torch_norm(x + delta, norm.weight, 1e-5))
        assert torch.equal(total, x + delta)


def test_bad_arguments_are_refused():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        pw.rms_norm(x.half(), torch.ones(8).half(), 1e-5)
    with pytest.raises(ValueError, match="does not fit"):
        pw.rms_norm(x, torch.ones(8, 1), 1e-5)
    with pytest.raises(ValueError, match="does not fit"):
        pw.add_rms_norm(x, torch.randn(2, 7), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="does not end in"):
        pw.rms_norm(torch.randn(2, 7), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="even"):
        pw.silu_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match=r"\[T, H, D\]"):
        pw.rotate_(torch.randn(2, 8), torch.ones(2, 8), torch.ones(2, 8))
    with pytest.raises(ValueError, match="do not fit"):
        pw.rotate_(torch.randn(2, 3, 8), torch.ones(3, 8), torch.ones(2, 8))
