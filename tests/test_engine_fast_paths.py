"""The engine's CPU fast paths compute what the plain formulations do: fused and packed
projections, the prepared rotary rotation, the oneDNN linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from edgeinfer.daemon.engine import linear as linear_module
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


@pytest.mark.usefixtures("pack_small")
@pytest.mark.parametrize("rows", [0, 1, 8, 300])
def test_linear_matches_f_linear(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 96, generator=gen), torch.randn(40, 96, generator=gen)
    b = torch.randn(40, generator=gen)
    torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.fixture
def pack_small(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let the small weights of these tests take the oneDNN paths (see the size rule below)."""
    monkeypatch.setattr(linear_module, "ONEDNN_MIN_FLOAT32_WEIGHT", 0)


def test_small_float32_weights_stay_on_f_linear() -> None:
    # oneDNN builds a kernel per new row count, which a small weight never earns back.
    small = torch.randn(64, 192)
    assert not can_pack(small)
    assert can_pack(torch.randn(576, 576)) == linear_module._ONEDNN
    layer = Linear(192, 64)
    layer.pack()
    assert layer.packed is None and layer.weight.shape == (64, 192)
    x = torch.randn(7, 192)
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


@pytest.mark.usefixtures("pack_small")
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
        torch.testing.assert_close(layer(x[:1]), before[:1], rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("pack_small")
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


def test_packed_bf16_linear_matches_f_linear() -> None:
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(40, 96, generator=gen) * 0.1).to(torch.bfloat16)
    if not can_pack(w):
        pytest.skip("this CPU has no bf16 dot products: bf16 weights stay unpacked")
    layer = Linear(96, 40, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(w)
    x = torch.randn(9, 96, generator=gen).to(torch.bfloat16)
    layer.pack()
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, w), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    ("checkpoint", "native", "expected"),
    [
        ("bfloat16", True, torch.bfloat16),  # the checkpoint's own dtype, computed natively
        ("bfloat16", False, torch.float32),  # emulated bf16 is slower than float32
        ("float32", True, torch.float32),
        ("float16", True, torch.float32),  # fp16 -> bf16 would drop mantissa bits
    ],
)
def test_auto_dtype_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch, checkpoint: str, native: bool, expected: torch.dtype
) -> None:
    from types import SimpleNamespace

    from edgeinfer.daemon.engine import config as engine_config

    monkeypatch.setattr(engine_config, "native_bf16", lambda: native)
    model_cfg = SimpleNamespace(torch_dtype=checkpoint)
    cfg = engine_config.EngineConfig(device="cpu")
    assert cfg.resolve_dtype(model_cfg) == expected  # type: ignore[arg-type]
    assert (
        engine_config.EngineConfig(device="cpu", dtype="float32").resolve_dtype(
            model_cfg  # type: ignore[arg-type]
        )
        == torch.float32
    )


@pytest.mark.usefixtures("pack_small")
def test_load_warms_every_packed_shape_for_each_decode_batch_size(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from edgeinfer.daemon.engine import model_runner
    from edgeinfer.daemon.engine.config import EngineConfig
    from edgeinfer.daemon.engine.llm_engine import LLMEngine
    from engine_helpers import make_checkpoint

    calls: list[tuple[int, tuple[int, ...]]] = []
    real = model_runner.linear

    def spy(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
        calls.append((x.shape[0], tuple(weight.shape)))
        return real(x, weight, bias)

    monkeypatch.setattr(model_runner, "linear", spy)
    checkpoint = make_checkpoint(tmp_path, "LlamaForCausalLM")
    engine = LLMEngine(EngineConfig(model=str(checkpoint), device="cpu", max_num_seqs=3))
    if not calls:
        pytest.skip("torch without oneDNN: nothing is packed, nothing to warm")
    cfg = engine.model_config
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {
        (q + 2 * kv, h),  # q|k|v
        (h, q),  # o_proj
        (2 * cfg.intermediate_size, h),  # gate|up
        (h, cfg.intermediate_size),  # down_proj
        (cfg.vocab_size, h),  # lm_head
    }
    assert sorted(calls) == sorted((rows, s) for s in shapes for rows in (1, 2, 3))
