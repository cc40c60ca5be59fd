"""The engine's attention trials: each compiled attention kernel against the path it replaces,
and the grouped layout of a chunk after a cached prefix against repeated heads.

* ``paged_decode_attention`` against what decode runs without it (numba's in-place kernel for
  wide KV heads, torch's planned SDPA for narrow ones) at 1, 4, 16, ... sequences of
  :data:`DECODE_CONTEXT` tokens; ``paged_prefill_attention`` against torch's flash SDPA at
  fresh chunks of 16, 64, 256, ... tokens.
* ``grouped_prefill_attention``: a chunk of 16, 64, 256, ... tokens after
  :data:`PREFIX_CONTEXT` cached ones (what a prefix-cache hit prefills), on torch's flash SDPA
  with a KV head's query heads as rows of one matrix against the same with the KV heads
  repeated (:mod:`edgeinfer.kernels.paged_attention_cpu`). Pure torch, so no build to wait for;
  it is timed with the compiled kernels' trials and, like them, only where those run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from edgeinfer.daemon.engine import cpu_attention
from edgeinfer.daemon.engine.model_config import ModelConfig
from edgeinfer.daemon.engine.trial_set import Setup, Sizes, TrialSet, dtype_name
from edgeinfer.kernels import native_build
from edgeinfer.kernels import paged_attention_native as native
from edgeinfer.kernels.kernel_choice import SizeRoute, Trial, powers_of_two
from edgeinfer.kernels.paged_attention_cpu import (
    bf16_matmul_prefill,
    paged_decode_attention_cpu,
    paged_prefill_attention_cpu,
    plan_decode_cpu,
    prefill_attention_cpu,
)
from edgeinfer.kernels.paged_attention_numba import paged_decode_attention_numba

DECODE_CONTEXT = 256  # tokens per sequence in the decode-attention trials
PREFIX_CONTEXT = 1024  # cached tokens before the chunk in the grouped-prefill trials
# What the grouped layout's timings are valid for (the cache is per torch version already):
# a new formulation of the layout is a new "build".
GROUPED_BUILD = "sdpa-grouped-1"


def _paged(cfg: ModelConfig, sizes: Sizes, seqs: int, tokens: int) -> tuple[Tensor, ...]:
    """K/V caches holding ``seqs`` sequences of ``tokens`` on shuffled pages, their tables and
    lengths (int32)."""
    page = sizes.block_size
    per_seq = -(-tokens // page)
    shape = (seqs * per_seq, page, cfg.num_kv_heads, cfg.head_dim)
    k_cache, v_cache = (torch.randn(shape).to(sizes.dtype) for _ in range(2))
    tables = torch.randperm(seqs * per_seq, dtype=torch.int32).view(seqs, per_seq)
    lens = torch.full((seqs,), tokens, dtype=torch.int32)
    return k_cache, v_cache, tables, lens


def _decode_setup(cfg: ModelConfig, sizes: Sizes, seqs: int, context: int) -> Setup:
    """Decode attention of ``seqs`` sequences: compiled, against the path without it (numba's
    in-place kernel for wide KV heads, torch's planned SDPA for narrow ones)."""

    def setup() -> tuple[Callable[[], object], Callable[[], object]]:
        dtype, heads, d = sizes.dtype, cfg.num_heads, cfg.head_dim
        values, scale = 2 * cfg.num_kv_heads * d, d**-0.5
        k_cache, v_cache, tables, lens = _paged(cfg, sizes, seqs, context)
        q, out = torch.randn(seqs, heads, d).to(dtype), torch.empty(seqs, heads, d, dtype=dtype)
        prepared = native.PreparedDecode(tables, lens, k_cache.shape, dtype, heads)
        if values >= cpu_attention.IN_PLACE_MIN_KV_VALUES:
            return (
                lambda: paged_decode_attention_numba(q, k_cache, v_cache, tables, lens, scale, out),
                lambda: prepared(q, k_cache, v_cache, scale, out),
            )
        plan = plan_decode_cpu(tables, lens, sizes.block_size, values * dtype.itemsize)
        return (
            lambda: paged_decode_attention_cpu(q, k_cache, v_cache, tables, lens, scale, plan, out),
            lambda: prepared(q, k_cache, v_cache, scale, out),
        )

    return setup


def _prefill_setup(cfg: ModelConfig, sizes: Sizes, tokens: int) -> Setup:
    """A fresh prompt chunk's attention: compiled (reading the pages), against torch's SDPA."""

    def setup() -> tuple[Callable[[], object], Callable[[], object]]:
        dtype, heads, kv_heads, d = sizes.dtype, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        k_cache, v_cache, tables, _ = _paged(cfg, sizes, 1, tokens)
        q, out = torch.randn(tokens, heads, d).to(dtype), torch.empty(tokens, heads, d, dtype=dtype)
        k, v = (torch.randn(tokens, kv_heads, d).to(dtype) for _ in range(2))
        scale = d**-0.5
        return (
            lambda: prefill_attention_cpu(q, k, v, scale),
            lambda: native.paged_prefill_attention_native(
                q, k_cache, v_cache, tables[0], 0, scale, out
            ),
        )

    return setup


def attention_sets(cfg: ModelConfig, sizes: Sizes) -> list[TrialSet]:
    dtype, heads, d = sizes.dtype, cfg.num_heads, cfg.head_dim
    probe = torch.empty(0, 1, cfg.num_kv_heads, d, dtype=dtype)
    if not native.supports(torch.empty(0, heads, d, dtype=dtype), probe):
        return []
    values = 2 * cfg.num_kv_heads * d
    shape = f"{heads}/{cfg.num_kv_heads}x{d} {dtype_name(dtype)}"
    sets = []
    if build := native_build.build_id("paged_decode_attention"):
        in_place = values >= cpu_attention.IN_PLACE_MIN_KV_VALUES
        baseline = "numba in place" if in_place else "torch SDPA plan"
        context = min(DECODE_CONTEXT, sizes.max_tokens)
        decodes = []
        for seqs in powers_of_two(sizes.max_num_seqs, step=2):
            case = f"{shape}, {seqs} seqs of {context} tokens"
            setup = _decode_setup(cfg, sizes, seqs, context)
            decodes.append(
                (seqs, Trial("paged_decode_attention", case, baseline, build, setup), True)
            )

        def decode_route(route: SizeRoute) -> None:
            cpu_attention.set_decode_route(dtype, values, route)

        sets.append(TrialSet("paged_decode_attention", decodes, decode_route))
    if build := native_build.build_id("paged_prefill_attention"):
        prefills = []
        for tokens in powers_of_two(sizes.max_tokens, step=2, smallest=16):
            case, setup = f"{shape}, {tokens} tokens", _prefill_setup(cfg, sizes, tokens)
            trial = Trial("paged_prefill_attention", case, "torch SDPA", build, setup)
            prefills.append((tokens, trial, False))

        def prefill_route(route: SizeRoute) -> None:
            cpu_attention.set_prefill_route(dtype, values, route)

        sets.append(TrialSet("paged_prefill_attention", prefills, prefill_route))
    return sets


def _grouped_setup(cfg: ModelConfig, sizes: Sizes, tokens: int, context: int) -> Setup:
    """A chunk of ``tokens`` after ``context`` cached ones, as a prefix-cache hit prefills it:
    KV heads repeated, against grouped query rows."""

    def setup() -> tuple[Callable[[], object], Callable[[], object]]:
        dtype, heads, d = sizes.dtype, cfg.num_heads, cfg.head_dim
        k_cache, v_cache, tables, _ = _paged(cfg, sizes, 1, context + tokens)
        q, table, scale = torch.randn(tokens, heads, d).to(dtype), tables[0], d**-0.5
        return (
            lambda: paged_prefill_attention_cpu(q, k_cache, v_cache, table, context, scale),
            lambda: paged_prefill_attention_cpu(q, k_cache, v_cache, table, context, scale, True),
        )

    return setup


def grouped_sets(cfg: ModelConfig, sizes: Sizes) -> list[TrialSet]:
    """The grouped layout's trials; none where every KV head has one query head (nothing to
    group) or bf16 runs as matmuls after a prefix (they group already)."""
    dtype = sizes.dtype
    if cfg.num_heads == cfg.num_kv_heads or bf16_matmul_prefill(dtype, 1, 1):
        return []
    shape = f"{cfg.num_heads}/{cfg.num_kv_heads}x{cfg.head_dim} {dtype_name(dtype)}"
    trials = []
    for tokens in powers_of_two(sizes.max_tokens, step=2, smallest=16):
        context = max(1, min(PREFIX_CONTEXT, sizes.max_tokens - tokens))
        case = f"{shape}, {tokens} tokens after {context}"
        setup = _grouped_setup(cfg, sizes, tokens, context)
        trial = Trial("grouped_prefill_attention", case, "heads repeated", GROUPED_BUILD, setup)
        trials.append((tokens, trial, False))
    values = 2 * cfg.num_kv_heads * cfg.head_dim

    def apply(route: SizeRoute) -> None:
        cpu_attention.set_grouped_route(dtype, values, route)

    return [TrialSet("grouped_prefill_attention", trials, apply)]
