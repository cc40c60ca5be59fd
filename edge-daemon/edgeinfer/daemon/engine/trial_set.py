"""The shape of the engine's kernel trials: what a trial set is, and what the trials take from the
engine's configuration (:mod:`edgeinfer.daemon.engine.kernel_trials` runs them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from edgeinfer.kernels.kernel_choice import SizeRoute, Trial

# A trial's inputs, made only when it is measured: (the baseline's call, the kernel's call).
Setup = Callable[[], tuple[Callable[[], object], Callable[[], object]]]


@dataclass(frozen=True)
class Sizes:
    """What the trials take from the engine's configuration."""

    dtype: torch.dtype
    block_size: int
    max_num_seqs: int  # decode batch sizes run up to this
    max_tokens: int  # prefill chunks run up to this (max_num_batched_tokens, max_model_len)


@dataclass
class TrialSet:
    """One kernel on one shape over sizes; ``apply`` puts the route where the engine reads it."""

    kernel: str
    trials: list[tuple[int, Trial, bool]]  # (size, trial, timed at decode threads)
    apply: Callable[[SizeRoute], None]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
