"""Validation and defaults of SamplingParams."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from edgeinfer.daemon.engine.errors import InvalidRequestError
from edgeinfer.daemon.engine.sampling_params import SamplingParams


def test_defaults() -> None:
    p = SamplingParams()
    assert p.max_tokens == 16
    assert p.temperature == 1.0
    assert (p.top_k, p.top_p, p.min_p) == (0, 1.0, 0.0)
    assert p.seed is None and p.logprobs is None
    assert p.stop == () and p.stop_token_ids == ()
    assert p.skip_special_tokens and not p.ignore_eos and not p.include_stop_str_in_output
    assert not p.greedy


def test_frozen_and_slotted() -> None:
    p = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.5  # type: ignore[misc]
    assert not hasattr(p, "__dict__")


def test_greedy() -> None:
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=1e-7).greedy
    assert not SamplingParams(temperature=0.01).greedy
    g = SamplingParams.greedy_params(max_tokens=5, seed=3)
    assert g.greedy and g.max_tokens == 5 and g.seed == 3


def test_normalisation() -> None:
    p = SamplingParams(temperature=1, stop=["a", "b"], stop_token_ids=[3, 4], top_p=1)
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert p.stop == ("a", "b") and p.stop_token_ids == (3, 4)
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(top_k=-1).top_k == -1
    # Normalised params compare and hash like the tuple form.
    assert hash(p) == hash(SamplingParams(temperature=1.0, stop=("a", "b"), stop_token_ids=(3, 4)))


@pytest.mark.parametrize(
    ("kwargs", "param", "message"),
    [
        ({"max_tokens": 0}, "max_tokens", "max_tokens must be >= 1, got 0"),
        ({"max_tokens": True}, "max_tokens", "max_tokens must be an integer, got bool"),
        ({"max_tokens": 2.0}, "max_tokens", "max_tokens must be an integer, got float"),
        ({"temperature": -1}, "temperature", "temperature must be >= 0, got -1"),
        ({"temperature": float("nan")}, "temperature", "temperature must be a finite float32"),
        ({"repetition_penalty": 1e307}, "repetition_penalty", "must be a finite float32 number"),
        ({"temperature": -1e39}, "temperature", "must be a finite float32 number"),
        ({"temperature": "1"}, "temperature", "temperature must be a number, got str"),
        ({"temperature": False}, "temperature", "temperature must be a number, got bool"),
        ({"top_k": -2}, "top_k", "top_k must be -1 or 0 (disabled) or >= 1, got -2"),
        ({"top_p": 0}, "top_p", "top_p must be in (0, 1], got 0"),
        ({"top_p": 1.5}, "top_p", "top_p must be in (0, 1], got 1.5"),
        ({"min_p": -0.1}, "min_p", "min_p must be in [0, 1], got -0.1"),
        ({"seed": 2**64}, "seed", "seed must be in ["),
        ({"seed": "7"}, "seed", "seed must be an integer, got str"),
        ({"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty must be > 0"),
        ({"presence_penalty": 2.5}, "presence_penalty", "presence_penalty must be in [-2, 2]"),
        ({"frequency_penalty": -3}, "frequency_penalty", "frequency_penalty must be in [-2, 2]"),
        ({"stop": [""]}, "stop", "stop must not hold empty strings"),
        ({"stop": ["x"] * 17}, "stop", "stop must hold at most 16 strings, got 17"),
        ({"stop": [1]}, "stop", "stop must hold strings, got int"),
        ({"stop": 5}, "stop", "stop must be a string or a list of strings"),
        ({"stop_token_ids": [-1]}, "stop_token_ids", "stop_token_ids must hold ids >= 0"),
        ({"stop_token_ids": [True]}, "stop_token_ids", "must be an integer, got bool"),
        ({"stop_token_ids": 3}, "stop_token_ids", "must be a list of integers, got int"),
        ({"ignore_eos": 1}, "ignore_eos", "ignore_eos must be a boolean, got int"),
        ({"skip_special_tokens": None}, "skip_special_tokens", "must be a boolean"),
        ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output", "boolean"),
        ({"min_tokens": -1}, "min_tokens", "min_tokens must be in [0, max_tokens=16], got -1"),
        ({"min_tokens": 17}, "min_tokens", "min_tokens must be in [0, max_tokens=16], got 17"),
        ({"logprobs": 21}, "logprobs", "logprobs must be in [0, 20], got 21"),
        ({"logprobs": -1}, "logprobs", "logprobs must be in [0, 20], got -1"),
    ],
)
def test_validation(kwargs: dict[str, Any], param: str, message: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert message in str(info.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"top_p": 1e-9},
        {"min_p": 1.0},
        {"logprobs": 0},
        {"logprobs": 20},
        {"seed": -(2**63)},
        {"presence_penalty": -2, "frequency_penalty": 2},
        {"min_tokens": 16},
        {"stop": ["x"] * 16},
        {"temperature": 0},
    ],
)
def test_boundaries_accepted(kwargs: dict[str, Any]) -> None:
    SamplingParams(**kwargs)
