"""RoPE inverse frequencies and cos/sin against transformers' own implementation."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from edgeinfer.daemon.engine.model_config import ModelConfig
from edgeinfer.daemon.engine.rope import RotaryEmbedding, apply_rotary, rope_inv_freq

ROPE_CASES: list[dict[str, Any] | None] = [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    },
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    {"rope_type": "yarn", "factor": 8.0, "beta_fast": 16, "mscale": 1.0, "mscale_all_dim": 0.5},
    {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.3, "truncate": False},
]


def hf_and_ours(scaling: dict[str, Any] | None, legacy: bool) -> tuple[LlamaConfig, ModelConfig]:
    kwargs: dict[str, Any] = {
        "vocab_size": 100,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
    }
    raw = dict(kwargs, architectures=["LlamaForCausalLM"])
    if legacy:
        raw.update(rope_theta=50000.0, rope_scaling=dict(scaling) if scaling else None)
    else:
        raw["rope_parameters"] = {"rope_theta": 50000.0, **(scaling or {})}
    hf = LlamaConfig(**kwargs, rope_parameters={"rope_theta": 50000.0, **(scaling or {})})
    return hf, ModelConfig.from_dict(raw)


@pytest.mark.parametrize("legacy", [False, True], ids=["rope_parameters", "rope_scaling"])
@pytest.mark.parametrize("scaling", ROPE_CASES, ids=lambda s: (s or {}).get("rope_type", "default"))
def test_inv_freq_matches_transformers(scaling: dict[str, Any] | None, legacy: bool) -> None:
    hf_cfg, cfg = hf_and_ours(scaling, legacy)
    if scaling is None:
        ref, ref_scale = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_cfg)
    else:
        ref, ref_scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_cfg)
    inv_freq, scale = rope_inv_freq(cfg)
    assert inv_freq.dtype == torch.float32 and inv_freq.shape == (cfg.head_dim // 2,)
    torch.testing.assert_close(inv_freq, ref, rtol=0, atol=0)
    assert scale == pytest.approx(ref_scale, rel=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", [None, ROPE_CASES[3]], ids=["default", "yarn"])
def test_cos_sin_and_rotation_match_transformers(
    scaling: dict[str, Any] | None, dtype: torch.dtype
) -> None:
    hf_cfg, cfg = hf_and_ours(scaling, legacy=False)
    ref_rope = LlamaRotaryEmbedding(hf_cfg)
    ours = RotaryEmbedding(cfg)
    # Out of order, repeated, and beyond the initial cache so the cache must grow.
    positions = torch.tensor([0, 5, 3, 4095, 5000, 9000, 5])
    cos, sin = ours(positions)
    assert ours.capacity >= 9001
    q = torch.randn(len(positions), 4, cfg.head_dim, generator=torch.Generator().manual_seed(0))
    q = q.to(dtype)
    ref_cos, ref_sin = ref_rope(q, positions[None, :])  # [1, T, D] in q's dtype
    torch.testing.assert_close(cos.to(dtype), ref_cos[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin.to(dtype), ref_sin[0], rtol=1e-6, atol=1e-6)
    # HF's layout is [B, H, T, D]; ours is [T, H, D].
    ref_q, _ = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], q.transpose(0, 1)[None], ref_cos, ref_sin
    )
    torch.testing.assert_close(
        apply_rotary(q, cos, sin), ref_q[0].transpose(0, 1), rtol=1e-6, atol=1e-6
    )


def test_known_max_position_and_empty_positions() -> None:
    _, cfg = hf_and_ours(None, legacy=False)
    rope = RotaryEmbedding(cfg)
    cos, _ = rope(torch.tensor([], dtype=torch.long))
    assert cos.shape == (0, cfg.head_dim) and rope.capacity == 0
    rope(torch.tensor([7]), max_position=7)
    assert rope.capacity == 4096
