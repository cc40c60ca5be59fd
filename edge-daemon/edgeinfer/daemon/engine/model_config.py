"""Model hyper-parameters parsed from a Hugging Face ``config.json``.

Only the decoder-only architectures the engine implements are accepted; everything the model code
needs is normalised here (old and new spellings of the RoPE settings, ``eos_token_id`` as int or
list, missing ``head_dim``) so the model code never reads the raw dictionary.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from edgeinfer.daemon.engine.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
# Configs written without an `architectures` list still carry `model_type`.
_MODEL_TYPE_TO_ARCHITECTURE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings; fields unused by ``rope_type`` keep their defaults."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    # llama3 and yarn: the context length the model was pre-trained with.
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool
    torch_dtype: str
    rope: RopeConfig
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The checkpoint's dtype as a torch dtype (float32 when the name is unknown)."""
        return _DTYPES.get(self.torch_dtype, torch.float32)

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise ModelLoadError(f"{config_path} not found: not a Hugging Face model directory")
        try:
            data = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"cannot read {config_path}: {exc}") from exc
        if not isinstance(data, dict):
            raise ModelLoadError(f"{config_path} does not hold a JSON object")
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        architecture = _architecture(d)
        hidden_size = _required_int(d, "hidden_size")
        num_heads = _required_int(d, "num_attention_heads")
        num_kv_heads = int(d.get("num_key_value_heads") or num_heads)
        # Mistral writes `"head_dim": null`; only a real value overrides hidden / heads.
        head_dim = int(d.get("head_dim") or 0)
        if head_dim == 0:
            if hidden_size % num_heads:
                raise ModelLoadError(
                    f"hidden_size {hidden_size} is not divisible by num_attention_heads {num_heads}"
                )
            head_dim = hidden_size // num_heads
        if num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads {num_heads} is not divisible by num_key_value_heads "
                f"{num_kv_heads}"
            )
        if head_dim % 2:
            raise ModelLoadError(f"head_dim {head_dim} must be even for rotary embeddings")

        max_positions = _required_int(d, "max_position_embeddings")
        if architecture == "Qwen2ForCausalLM":
            # Qwen2 always has q/k/v biases; its config has no switch for them.
            attention_bias = True
        else:
            attention_bias = bool(d.get("attention_bias", False))
        sliding_window = d.get("sliding_window")
        if architecture == "Qwen2ForCausalLM" and not d.get("use_sliding_window", False):
            sliding_window = None

        return cls(
            architecture=architecture,
            vocab_size=_required_int(d, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_required_int(d, "intermediate_size"),
            num_layers=_required_int(d, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=architecture == "Qwen3ForCausalLM",
            torch_dtype=str(d.get("dtype") or d.get("torch_dtype") or "float32"),
            rope=_rope_config(d, max_positions),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_token_ids(d.get("eos_token_id")),
            sliding_window=int(sliding_window) if sliding_window else None,
        )


def _architecture(d: dict[str, Any]) -> str:
    architectures = d.get("architectures") or []
    if architectures:
        name = architectures[0]
    else:
        name = _MODEL_TYPE_TO_ARCHITECTURE.get(d.get("model_type", ""), str(d.get("model_type")))
    if name not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture {name!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return name


def _required_int(d: dict[str, Any], key: str) -> int:
    value = d.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelLoadError(f"config.json: {key!r} must be a positive integer, got {value!r}")
    return value


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_config(d: dict[str, Any], max_positions: int) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters` (theta inside); older configs use a top-level
    # `rope_theta` and an optional `rope_scaling` dict whose type key was once called `type`.
    params: dict[str, Any] = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    original = params.get("original_max_position_embeddings")
    if rope_type in ("llama3", "yarn"):
        # Same precedence as transformers: a top-level value wins, else the current maximum.
        original = int(d.get("original_max_position_embeddings") or original or max_positions)
    factor = params.get("factor")
    if factor is None:
        if rope_type in ("linear", "llama3"):
            raise ModelLoadError(f"rope_type {rope_type!r} requires 'factor'")
        factor = max_positions / original if rope_type == "yarn" and original else 1.0
    if float(factor) <= 0:
        raise ModelLoadError(f"rope factor must be positive, got {factor}")

    def opt_float(key: str) -> float | None:
        value = params.get(key)
        return None if value is None else float(value)

    return RopeConfig(
        rope_type=rope_type,
        theta=theta,
        factor=float(factor),
        original_max_position_embeddings=original,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        # transformers treats a falsy beta as "use the default".
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=opt_float("attention_factor"),
        mscale=opt_float("mscale"),
        mscale_all_dim=opt_float("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
    )
