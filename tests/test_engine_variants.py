"""Checkpoint variants: RoPE scaling types, half-precision weights, sharded safetensors."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from edgeinfer.daemon.engine.config import EngineConfig
from edgeinfer.daemon.engine.llm_engine import LLMEngine
from edgeinfer.daemon.engine.sampling_params import SamplingParams
from edgeinfer.daemon.engine.tiny_checkpoint import build_tiny_checkpoint
from edgeinfer.kernels.cpu_features import native_bf16
from engine_helpers import assert_matches, hf_greedy, random_prompts

MAX_NEW = 8

ROPE_CASES = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
}


@pytest.mark.parametrize("rope", list(ROPE_CASES))
def test_rope_scaling_matches_hf(tmp_path, rope):
    path = build_tiny_checkpoint(tmp_path / rope, rope_scaling=ROPE_CASES[rope], sharded=True)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = random_prompts(6, hf.config.vocab_size, max_len=400, seed=7)
    engine = LLMEngine(EngineConfig(model=str(path), max_num_batched_tokens=128))
    params = SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0.0)
    outputs = engine.generate(prompts, params)
    with torch.inference_mode():
        for i, (prompt, out) in enumerate(zip(prompts, outputs)):
            assert_matches(out.token_ids, hf_greedy(hf, prompt, MAX_NEW), f"{rope} prompt {i}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoint(tmp_path, dtype):
    path = build_tiny_checkpoint(tmp_path / str(dtype), dtype=dtype)
    prompts = random_prompts(3, 512, max_len=60, seed=1)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    as_f32 = LLMEngine(EngineConfig(model=str(path), dtype="float32"))
    native = LLMEngine(EngineConfig(model=str(path), dtype=str(dtype).split(".")[1]))
    assert native.runner.kv_cache.k[0].dtype == dtype
    assert as_f32.runner.kv_cache.k[0].dtype == torch.float32
    # auto on the CPU: bf16 stays bf16 where the CPU computes it natively; else float32.
    auto = EngineConfig(model=str(path)).resolve_dtype(native.model_config)
    assert auto == (dtype if dtype == torch.bfloat16 and native_bf16() else torch.float32)
    for out in native.generate(prompts, params):
        assert len(out.token_ids) == 6
    logits32 = as_f32.prompt_logits(prompts[0])
    logits16 = native.prompt_logits(prompts[0])
    assert torch.isfinite(logits16).all()
    # Same weights, lower-precision activations: close, not equal.
    assert (logits32 - logits16).abs().max() < 0.1 * logits32.abs().max()
