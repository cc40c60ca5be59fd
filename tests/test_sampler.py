"""Batched sampler: greedy, truncation masks, penalties, seeds, distribution, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from edgeinfer.daemon.engine.sampler import (
    Sampler,
    SamplingState,
    apply_min_tokens,
    apply_penalties,
)
from edgeinfer.daemon.engine.sampling_params import SamplingParams

VOCAB = 64


def state(prompt: tuple[int, ...] = (1, 2, 3), eos: tuple[int, ...] = (), **kw) -> SamplingState:
    return SamplingState(SamplingParams(**kw), prompt, eos)


def random_logits(rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def run(logits: torch.Tensor, states: list[SamplingState], steps: int = 1) -> list[list[int]]:
    """Sample ``steps`` times with the same logits, appending the tokens; ids per row."""
    out: list[list[int]] = [[] for _ in states]
    sampler = Sampler()
    for _ in range(steps):
        tokens = sampler.sample(logits, states).token_ids
        for row, (s, t) in enumerate(zip(states, tokens)):
            s.append(t)
            out[row].append(t)
    return out


def test_greedy_is_argmax_with_lowest_id_on_ties() -> None:
    logits = random_logits(4)
    logits[2, 10] = logits[2, 20] = logits[2].max() + 1
    result = Sampler().sample(logits, [state(temperature=0) for _ in range(4)])
    assert result.token_ids == logits.argmax(dim=-1).tolist()
    assert result.token_ids[2] == 10
    assert result.logprobs == [None] * 4 and result.top_logprobs == [None] * 4


def test_caller_logits_untouched() -> None:
    logits = random_logits(2)
    before = logits.clone()
    Sampler().sample(logits, [state(repetition_penalty=2.0), state(min_p=0.5, top_k=3)])
    assert torch.equal(logits, before)


def test_top_k_1_and_tiny_top_p_are_greedy() -> None:
    logits = random_logits(8, seed=1)
    logits[0, 5] = logits[0, 9] = logits[0].max() + 1  # tie: top_k=1 keeps id 5 like argmax
    expected = logits.argmax(dim=-1).tolist()
    for kw in ({"top_k": 1}, {"top_p": 1e-6}):
        states = [state(temperature=1.5, seed=i, **kw) for i in range(8)]
        assert run(logits, states, steps=5) == [[t] * 5 for t in expected], kw
    # min_p = 1 keeps every token tied with the maximum, so skip the tied row.
    states = [state(temperature=1.5, seed=i, min_p=1.0) for i in range(7)]
    assert run(logits[1:], states, steps=5) == [[t] * 5 for t in expected[1:]]


def test_min_p_masks_unlikely_tokens() -> None:
    probs = torch.tensor([0.4, 0.25, 0.19, 0.16])  # min_p 0.5 -> threshold 0.2
    logits = probs.log().expand(2000, 4).contiguous()
    torch.manual_seed(0)
    tokens = Sampler().sample(logits, [state(min_p=0.5) for _ in range(2000)]).token_ids
    assert set(tokens) == {0, 1}


def frequencies(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).float() / len(tokens)


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        ({}, [0.1, 0.2, 0.3, 0.4]),
        ({"temperature": 2.0}, [math.sqrt(p) for p in (0.1, 0.2, 0.3, 0.4)]),
        ({"top_k": 2}, [0.0, 0.0, 0.3, 0.4]),
        ({"top_p": 0.65}, [0.0, 0.0, 0.3, 0.4]),  # mass before token 2 is 0.4 < 0.65
        ({"top_k": 3, "top_p": 0.5}, [0.0, 0.0, 0.3 / 0.9, 0.4 / 0.9]),
    ],
)
def test_distribution_matches_seeded(kw: dict[str, float], expected: list[float]) -> None:
    n = 4000
    logits = torch.tensor([0.1, 0.2, 0.3, 0.4]).log().expand(n, 4).contiguous()
    states = [state(seed=1000 + i, **kw) for i in range(n)]
    tokens = Sampler().sample(logits, states).token_ids
    target = torch.tensor(expected) / sum(expected)
    # 4000 draws: standard error <= 0.008 per bin, so 0.035 is > 4 sigma.
    assert torch.allclose(frequencies(tokens, 4), target, atol=0.035)


def test_unseeded_distribution_uses_global_rng() -> None:
    n = 4000
    logits = torch.tensor([0.5, 0.25, 0.25]).log().expand(n, 3).contiguous()
    torch.manual_seed(1)
    first = Sampler().sample(logits, [state() for _ in range(n)]).token_ids
    torch.manual_seed(1)
    again = Sampler().sample(logits, [state() for _ in range(n)]).token_ids
    assert first == again
    assert torch.allclose(frequencies(first, 3), torch.tensor([0.5, 0.25, 0.25]), atol=0.035)


def test_seed_is_independent_of_batch_neighbours() -> None:
    logits = random_logits(1, seed=3)
    alone = run(logits, [state(seed=42, top_p=0.9)], steps=20)[0]
    batch_logits = torch.cat([random_logits(3, seed=4), logits, random_logits(2, seed=5)])
    neighbours = [
        state(temperature=0),
        state(seed=7, top_k=5, min_p=0.1),
        state(repetition_penalty=1.2, logprobs=3),
        state(seed=42, top_p=0.9),
        state(temperature=0.7, presence_penalty=1.0),
        state(seed=42),
    ]
    torch.manual_seed(123)  # unseeded neighbours draw from the global RNG; must not matter
    assert run(batch_logits, neighbours, steps=20)[3] == alone
    other_seed = run(logits, [state(seed=43, top_p=0.9)], steps=20)[0]
    assert other_seed != alone


def test_penalties_match_hand_computation() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    s = state(prompt=(0, 1), repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    for token in (3, 3, 4):
        s.append(token)
    apply_penalties(logits, [s])
    # rep: ids 0,1 (prompt), 3,4 (output); freq/presence on output ids only (3 x2, 4 x1).
    expected = [2.0 / 2, -1.0 * 2, 0.5, 3.0 / 2 - 0.5 - 0.25 * 2, -2.0 * 2 - 0.5 - 0.25, 1.0]
    assert torch.allclose(logits[0], torch.tensor(expected))


def test_repetition_penalty_matches_transformers() -> None:
    logits = random_logits(1, seed=9, vocab=128)
    prompt, output = [5, 7, 7, 100, 3], [9, 5, 64, 64]
    s = state(prompt=tuple(prompt), repetition_penalty=1.3)
    for t in output:
        s.append(t)
    reference = RepetitionPenaltyLogitsProcessor(penalty=1.3)(
        torch.tensor([prompt + output]), logits.clone()
    )
    ours = logits.clone()
    apply_penalties(ours, [s])
    assert torch.allclose(ours, reference)


def test_penalties_change_only_their_rows() -> None:
    logits = random_logits(3, seed=2)
    states = [state(), state(frequency_penalty=1.0), state()]
    for s in states:
        s.append(4)
    out = logits.clone()
    apply_penalties(out, states)
    assert torch.equal(out[[0, 2]], logits[[0, 2]])
    assert out[1, 4] == logits[1, 4] - 1.0


def test_min_tokens_blocks_eos_and_stop_ids() -> None:
    logits = torch.zeros(1, 8)
    logits[0, 7], logits[0, 6], logits[0, 5] = 9.0, 8.0, 7.0  # eos 7, stop id 6
    s = state(eos=(7,), temperature=0, min_tokens=2, stop_token_ids=[6, 100])
    assert run(logits, [s], steps=3)[0] == [5, 5, 7]
    ignore = state(eos=(7,), temperature=0, min_tokens=2, stop_token_ids=[6], ignore_eos=True)
    assert run(logits, [ignore], steps=1)[0] == [7]
    masked = logits.clone()
    apply_min_tokens(masked, [state(eos=(7,), min_tokens=1)])
    assert masked[0, 7] == float("-inf") and masked[0, 6] == 8.0


def test_logprobs_are_raw_log_softmax() -> None:
    logits = random_logits(3, seed=6)
    states = [
        state(logprobs=5, temperature=0.5, repetition_penalty=1.5, seed=1),
        state(),
        state(logprobs=0, temperature=0),
    ]
    result = Sampler().sample(logits, states)
    ref = torch.log_softmax(logits, dim=-1)
    for row in (0, 2):
        token = result.token_ids[row]
        assert result.logprobs[row] == pytest.approx(ref[row, token].item(), abs=1e-6)
    assert result.logprobs[1] is None and result.top_logprobs[1] is None
    assert result.top_logprobs[2] == []
    top = result.top_logprobs[0]
    assert top is not None and len(top) == 5
    values, ids = ref[0].topk(5)
    assert [t for t, _ in top] == ids.tolist()
    assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-6)


def test_batch_of_one_and_shape_check() -> None:
    logits = random_logits(1)
    assert Sampler().sample(logits, [state(temperature=0)]).token_ids == [int(logits.argmax())]
    with pytest.raises(ValueError, match="do not match"):
        Sampler().sample(logits, [state(), state()])
