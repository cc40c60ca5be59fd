"""The engine's CPU fast paths compute what the plain formulations do: fused and packed
projections, the prepared rotary rotation, the oneDNN linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from edgeinfer.daemon.engine.linear import Linear, can_pack, linear
from edgeinfer.daemon.engine.model import FusedProjection
from edgeinfer.daemon.engine.rope import Rotation, apply_rotary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_equals_apply_rotary_bitwise(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 5, 64, generator=gen).to(dtype)
    angles = torch.rand(7, 32, generator=gen) * 100
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    assert torch.equal(Rotation.build(cos, sin, dtype).apply(x), apply_rotary(x, cos, sin))


@pytest.mark.parametrize("rows", [0, 1, 8, 300])
def test_linear_matches_f_linear(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 96, generator=gen), torch.randn(40, 96, generator=gen)
    b = torch.randn(40, generator=gen)
    torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_packed_linear_keeps_or_drops_the_weight() -> None:
    layer = Linear(96, 40)
    shared = Linear(96, 40, bias=False)
    x = torch.randn(5, 96)
    with torch.no_grad():
        before, before_shared = layer(x), shared(x)
    layer.pack()
    shared.pack(keep_weight=True)
    if not can_pack(shared.weight):
        pytest.skip("torch without oneDNN: packing is a no-op")
    assert layer.weight.numel() == 0 and shared.weight.shape == (40, 96)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), before, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(shared(x), before_shared, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_fused_projection_views_load_and_pack(bias: bool) -> None:
    parts = [Linear(32, n, bias=bias) for n in (24, 8, 8)]
    fused = FusedProjection(*parts)
    x = torch.randn(3, 32)
    with torch.no_grad():
        separate = torch.cat([p(x) for p in parts], dim=-1)
        torch.testing.assert_close(fused(x), separate)  # unfused fallback
        fused.fuse()
        assert fused.weight is not None
        assert parts[1].weight.data_ptr() == fused.weight[24:].data_ptr()
        # Loading into a parameter after fusing (what the engine does) updates the fused weight.
        parts[2].weight.copy_(torch.ones(8, 32))
        expected = torch.cat([p(x) for p in parts], dim=-1)
        torch.testing.assert_close(fused(x), expected, rtol=1e-5, atol=1e-5)
        fused.pack()
        torch.testing.assert_close(fused(x), expected, rtol=1e-5, atol=1e-5)
    if can_pack(torch.empty(1)):
        assert all(p.weight.numel() == 0 for p in parts)


def test_fused_projection_rejects_mixed_bias() -> None:
    with pytest.raises(ValueError, match="bias"):
        FusedProjection(Linear(4, 4, bias=True), Linear(4, 4, bias=False))
