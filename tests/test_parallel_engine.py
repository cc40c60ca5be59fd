"""Tensor and pipeline parallel engines (gloo on the CPU) against one process (issue: parallel)."""

from __future__ import annotations

import pytest
import torch

from edgeinfer.daemon.engine.llm_engine import LLMEngine
from edgeinfer.daemon.engine.sampling_params import SamplingParams
from parallel_helpers import ARCHS, GREEDY, LAYOUTS, PROMPTS, Engines, engines_fixture, tokens

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    yield from engines_fixture(tmp_path_factory.mktemp("parallel"))


@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=lambda v: str(v))
@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_one_process(engines: Engines, arch: str, tp: int, pp: int) -> None:
    single, par = engines.get(arch), engines.get(arch, tp, pp)
    for prompt in PROMPTS[:3]:
        want, got = single.prompt_logits(prompt), par.prompt_logits(prompt)
        assert got.shape == want.shape
        assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()


@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=lambda v: str(v))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_one_process(engines: Engines, arch: str, tp: int, pp: int) -> None:
    assert tokens(engines.get(arch, tp, pp)) == tokens(engines.get(arch))


def test_replicated_kv_heads(engines: Engines) -> None:
    """One KV head at TP=2: both ranks hold a copy; exports carry it once."""
    arch = "LlamaForCausalLM"
    single, par = engines.get(arch, num_kv_heads=1), engines.get(arch, 2, 1, num_kv_heads=1)
    assert torch.allclose(
        par.prompt_logits(PROMPTS[1]), single.prompt_logits(PROMPTS[1]), atol=1e-4
    )
    assert tokens(par, PROMPTS[:3]) == tokens(single, PROMPTS[:3])
    assert _exported(par, PROMPTS[1])[0][0].shape[2] == 1


def _exported(engine: LLMEngine, prompt: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    engine.add_request("x", prompt, SamplingParams(max_tokens=1), prefill_only=True)
    while engine.has_unfinished_requests():
        engine.step()
    try:
        return engine.export_kv("x", 0, -(-len(prompt) // engine.config.block_size))
    finally:
        engine.release("x")


@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=lambda v: str(v))
def test_kv_export_has_the_full_layout(engines: Engines, tp: int, pp: int) -> None:
    arch = "LlamaForCausalLM"
    want = _exported(engines.get(arch), PROMPTS[1])
    got = _exported(engines.get(arch, tp, pp), PROMPTS[1])
    assert len(got) == len(want)
    for (gk, gv), (wk, wv) in zip(got, want, strict=True):
        assert gk.shape == wk.shape
        assert torch.allclose(gk, wk, atol=1e-4) and torch.allclose(gv, wv, atol=1e-4)


@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=lambda v: str(v))
def test_kv_import_resplits_heads_and_layers(engines: Engines, tp: int, pp: int) -> None:
    """Pages prefilled by one process decode on a parallel engine (as the decode side)."""
    arch = "LlamaForCausalLM"
    single, par = engines.get(arch), engines.get(arch, tp, pp)
    prompt = PROMPTS[1]
    pages = _exported(single, prompt)
    want = tokens(single, [prompt])[0]
    cached = par.reserve_remote("r", prompt, GREEDY)
    first = cached // par.config.block_size
    for layer, (k, v) in enumerate(pages):
        par.import_kv("r", first, layer, k[first:], v[first:])
    got = list(par.commit_remote("r", want[0]).new_token_ids)
    while par.has_unfinished_requests():
        for out in par.step():
            got.extend(out.new_token_ids)
    assert got == want
