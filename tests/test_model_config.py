"""ModelConfig parsing: architectures, RoPE spellings, token ids and validation errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from edgeinfer.daemon.engine.errors import ModelLoadError
from edgeinfer.daemon.engine.model_config import ModelConfig


def base(**overrides: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 1000,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }
    d.update(overrides)
    return d


def test_llama_defaults() -> None:
    cfg = ModelConfig.from_dict(base())
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 16)
    assert not cfg.attention_bias and not cfg.mlp_bias and not cfg.qk_norm
    assert not cfg.tie_word_embeddings
    assert cfg.torch_dtype == "bfloat16"
    assert cfg.rope.rope_type == "default" and cfg.rope.theta == 500000.0
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)


def test_per_architecture_flags() -> None:
    qwen2 = ModelConfig.from_dict(base(architectures=["Qwen2ForCausalLM"]))
    assert qwen2.attention_bias and not qwen2.qk_norm
    qwen3 = ModelConfig.from_dict(base(architectures=["Qwen3ForCausalLM"], head_dim=32))
    assert qwen3.qk_norm and qwen3.head_dim == 32 and not qwen3.attention_bias
    llama = ModelConfig.from_dict(base(attention_bias=True, mlp_bias=True))
    assert llama.attention_bias and llama.mlp_bias
    mistral = ModelConfig.from_dict(base(architectures=["MistralForCausalLM"], head_dim=None))
    assert mistral.head_dim == 16


def test_eos_list_and_new_dtype_key() -> None:
    cfg = ModelConfig.from_dict(base(eos_token_id=[2, 7], dtype="float16", torch_dtype=None))
    assert cfg.eos_token_ids == (2, 7)
    assert cfg.torch_dtype == "float16"


def test_rope_scaling_legacy_spelling() -> None:
    cfg = ModelConfig.from_dict(base(rope_scaling={"type": "linear", "factor": 4.0}))
    assert cfg.rope.rope_type == "linear" and cfg.rope.factor == 4.0
    assert cfg.rope.theta == 500000.0


def test_rope_parameters_new_spelling() -> None:
    params = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    d = base(rope_parameters=params)
    del d["rope_theta"]
    cfg = ModelConfig.from_dict(d)
    assert cfg.rope.rope_type == "llama3" and cfg.rope.theta == 500000.0
    assert cfg.rope.original_max_position_embeddings == 8192


def test_yarn_defaults_original_to_max_positions() -> None:
    cfg = ModelConfig.from_dict(base(rope_scaling={"rope_type": "yarn", "factor": 2.0}))
    assert cfg.rope.original_max_position_embeddings == 4096
    assert (cfg.rope.beta_fast, cfg.rope.beta_slow) == (32.0, 1.0)


def test_unknown_architecture_names_it_and_the_supported_list() -> None:
    with pytest.raises(ModelLoadError) as info:
        ModelConfig.from_dict(base(architectures=["GPT2LMHeadModel"]))
    message = str(info.value)
    assert "GPT2LMHeadModel" in message
    assert "LlamaForCausalLM" in message and "Qwen3ForCausalLM" in message


def test_model_type_fallback() -> None:
    d = base(model_type="qwen2")
    del d["architectures"]
    assert ModelConfig.from_dict(d).architecture == "Qwen2ForCausalLM"


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"num_key_value_heads": 3}, "not divisible by num_key_value_heads"),
        ({"hidden_size": 66}, "not divisible by num_attention_heads"),
        ({"vocab_size": 0}, "'vocab_size'"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "unsupported rope_type"),
        ({"rope_scaling": {"rope_type": "linear"}}, "requires 'factor'"),
    ],
)
def test_validation_errors(overrides: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ModelLoadError, match=fragment):
        ModelConfig.from_dict(base(**overrides))


def test_from_dir(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(base()))
    assert ModelConfig.from_dir(tmp_path).vocab_size == 1000
