"""Shared helpers for engine tests: tiny checkpoints and a Hugging Face greedy reference."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from edgeinfer.daemon.engine.tiny_checkpoint import build_tiny_checkpoint

ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

# Near-ties: two correct implementations may legitimately pick different tokens there.
TIE_MARGIN = 1e-3


def make_checkpoint(root: Path, architecture: str, **overrides) -> Path:
    kwargs = {"tie_word_embeddings": architecture in ("Qwen2ForCausalLM", "LlamaForCausalLM")}
    kwargs.update(overrides)
    return build_tiny_checkpoint(root / architecture, architecture=architecture, **kwargs)


def random_prompts(
    n: int, vocab: int, min_len: int = 1, max_len: int = 300, seed: int = 0
) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [min_len, max_len] + [rng.randint(min_len, max_len) for _ in range(n - 2)]
    # Start at id 3 to keep clear of special tokens.
    return [[rng.randrange(3, vocab) for _ in range(length)] for length in lengths]


@dataclass
class Reference:
    tokens: list[int]
    margins: list[float]  # top-2 logit margin at each generated position


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> Reference:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    margins = []
    # Scores after HF's processors: min_new_tokens masks EOS, as min_tokens does for us.
    for step_logits in out.scores:
        top2 = torch.topk(step_logits[0].float(), 2).values
        margins.append(float(top2[0] - top2[1]))
    return Reference(tokens, margins)


def assert_matches(got: list[int], ref: Reference, context: str) -> None:
    """Equal token for token, except that comparison stops at the first near-tie."""
    for i, want in enumerate(ref.tokens):
        if ref.margins[i] < TIE_MARGIN:
            return
        if i >= len(got) or got[i] != want:
            raise AssertionError(
                f"{context}: token {i} differs: engine {got[: i + 1]} vs HF {ref.tokens[: i + 1]}"
            )
