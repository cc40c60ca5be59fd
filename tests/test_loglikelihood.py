"""Loglikelihood scoring as evaluation harnesses ask for it (echo, max_tokens 0, logprobs):
the daemon's log-probs equal transformers' forward pass within 1e-4 (float32), and every
multiple-choice question picks the same answer. bench/loglikelihood.py runs 200 pairs."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
from transformers import AutoModelForCausalLM

from daemon_helpers import daemon_config, start
from edgeinfer.daemon.engine.config import EngineConfig
from edgeinfer.daemon.engine.llm_engine import LLMEngine
from edgeinfer.daemon.engine.sampling_params import SamplingParams

QUESTIONS = 5
CHOICES = 4  # 20 (context, continuation) pairs
WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "while",
    "dog",
    "ran",
    "to",
    "park",
    "and",
    "bird",
    "sang",
    "in",
    "old",
    "tree",
    "near",
    "river",
]


@pytest_asyncio.fixture
async def client(aiohttp_client: Any, checkpoint: Path, llm: LLMEngine) -> Any:
    # Small steps: long pairs are scored across several prefill chunks.
    return await start(aiohttp_client, daemon_config(checkpoint, max_num_batched_tokens=24), llm)


def questions(llm: LLMEngine) -> list[tuple[list[int], list[list[int]]]]:
    rng = random.Random(3)
    out = []
    for _ in range(QUESTIONS):
        context = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 30)))
        answers = [" " + " ".join(rng.choices(WORDS, k=rng.randint(1, 5))) for _ in range(CHOICES)]
        tok = llm.tokenizer
        out.append(
            (tok.encode(context), [tok.encode(a, add_special_tokens=False) for a in answers])
        )
    return out


@pytest.fixture(scope="module")
def hf(checkpoint: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_scores(model: Any, ids: list[int], ctxlen: int) -> list[float]:
    logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    targets = torch.tensor(ids[ctxlen:]).unsqueeze(1)
    return logprobs[ctxlen - 1 : -1].gather(1, targets).squeeze(1).tolist()


@pytest.mark.asyncio
async def test_loglikelihoods_match_transformers(client: Any, llm: LLMEngine, hf: Any) -> None:
    worst = 0.0
    for context, answers in questions(llm):
        ours, theirs = [], []
        for answer in answers:
            body = {"prompt": context + answer, "max_tokens": 0, "echo": True, "logprobs": 1,
                    "temperature": 0}  # fmt: skip
            resp = await client.post("/v1/completions", json=body)
            assert resp.status == 200
            choice = (await resp.json())["choices"][0]
            assert choice["logprobs"]["token_logprobs"][0] is None
            got = choice["logprobs"]["token_logprobs"][len(context) :]
            want = hf_scores(hf, context + answer, len(context))
            assert len(got) == len(want) == len(answer)
            worst = max(worst, *(abs(a - b) for a, b in zip(got, want)))
            ours.append(sum(got))
            theirs.append(sum(want))
        assert ours.index(max(ours)) == theirs.index(max(theirs))
    assert worst <= 1e-4


@pytest.mark.parametrize(
    "config",
    [
        {"max_num_batched_tokens": 16},  # prompts split across many prefill steps
        {"num_kv_blocks": 12, "max_num_batched_tokens": 32},  # preemption: recomputed prompts
    ],
    ids=["chunked", "preempted"],
)
def test_engine_scores_every_prompt_position(checkpoint: Path, config: dict[str, Any]) -> None:
    engine = LLMEngine(EngineConfig(model=str(checkpoint), device="cpu", **config))
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(20, 60))] for _ in range(6)]
    # A plain run first fills the prefix cache: scored requests must not take its blocks.
    engine.generate(prompts[:3], SamplingParams.greedy_params(4))
    params = SamplingParams.greedy_params(8, ignore_eos=True, prompt_logprobs=1)
    results = engine.generate(prompts, params)
    if "num_kv_blocks" in config:
        assert engine.stats().num_preemptions > 0
    for prompt, result in zip(prompts, results, strict=True):
        want = torch.log_softmax(engine.prompt_logits(prompt), dim=-1)
        scores = result.prompt_logprobs
        assert scores is not None and len(scores) == len(prompt) and scores[0] is None
        for i in range(1, len(prompt)):
            score = scores[i]
            assert score is not None and score.token_id == prompt[i]
            assert abs(score.logprob - want[i - 1, prompt[i]].item()) < 1e-5
            assert len(score.top) == 1 and score.top[0][0] == int(want[i - 1].argmax())
