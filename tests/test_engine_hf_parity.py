"""The engine's greedy output equals transformers' generate() token for token."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from edgeinfer.daemon.engine import linear as linear_module
from edgeinfer.daemon.engine.config import EngineConfig
from edgeinfer.daemon.engine.llm_engine import LLMEngine
from edgeinfer.daemon.engine.sampling_params import SamplingParams
from edgeinfer.kernels import skinny_gemm
from engine_helpers import ARCHITECTURES, assert_matches, hf_greedy, make_checkpoint, random_prompts

MAX_NEW = 10
NUM_PROMPTS = 20


@pytest.fixture(scope="module", params=ARCHITECTURES)
def case(request, tmp_path_factory):
    arch = request.param
    path = make_checkpoint(tmp_path_factory.mktemp("ckpt"), arch)
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    prompts = random_prompts(NUM_PROMPTS, hf.config.vocab_size, seed=len(arch))
    with torch.inference_mode():
        refs = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    return arch, path, hf, prompts, refs


def _run(path, prompts, **cfg) -> tuple[LLMEngine, list[list[int]]]:
    engine = LLMEngine(EngineConfig(model=str(path), **cfg))
    params = SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0.0)
    results = engine.generate(prompts, params)
    return engine, [r.token_ids for r in results]


CONFIGS = {
    "default": {},
    "no-prefix-cache": {"enable_prefix_caching": False},
    "small-chunks": {"max_num_batched_tokens": 48},
    "tiny-pool": {"num_kv_blocks": 40, "max_num_batched_tokens": 64},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_hf(case, name):
    arch, path, _, prompts, refs = case
    engine, outputs = _run(path, prompts, **CONFIGS[name])
    for i, (got, ref) in enumerate(zip(outputs, refs)):
        assert_matches(got, ref, f"{arch}/{name} prompt {i} (len {len(prompts[i])})")
    stats = engine.stats()
    if name == "tiny-pool":
        assert stats.num_preemptions > 0, "the small pool was meant to force preemption"
    assert stats.kv_blocks_used == 0 or engine.config.enable_prefix_caching
    assert stats.num_running == stats.num_waiting == 0


def test_greedy_matches_hf_on_packed_and_skinny_weights(case, monkeypatch):
    # The tiny checkpoints' weights are under oneDNN's size threshold; lifting it packs every
    # projection, and with at most 8 sequences every decode step then takes skinny_gemm.
    monkeypatch.setattr(linear_module, "ONEDNN_MIN_FLOAT32_WEIGHT", 0)
    arch, path, _, prompts, refs = case
    engine, outputs = _run(path, prompts, max_num_seqs=8)
    if skinny_gemm.available() and linear_module.can_pack(torch.ones(1)):
        layer = engine.runner.model.model.layers[0]
        assert layer.mlp.gate_up.skinny is not None
    for i, (got, ref) in enumerate(zip(outputs, refs)):
        assert_matches(got, ref, f"{arch}/packed prompt {i} (len {len(prompts[i])})")


def test_prefill_logits_match_hf(case):
    arch, path, hf, prompts, _ = case
    engine = LLMEngine(EngineConfig(model=str(path)))
    for prompt in prompts[:4]:
        ours = engine.prompt_logits(prompt)
        with torch.inference_mode():
            theirs = hf(torch.tensor([prompt])).logits[0].float()
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4, msg=f"{arch} logits")
