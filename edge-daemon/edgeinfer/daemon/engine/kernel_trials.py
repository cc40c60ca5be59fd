"""What the engine times at load: each compiled CPU kernel against the call it replaces, on this
model's shapes, and where each answer goes.

* ``skinny_gemm`` against oneDNN's packed matmul: per projection shape (all the model's weights
  of that shape, one after another, as a decode step streams them), at 1, 2, 4 and 8 rows, in
  the model's dtype (float32, or bfloat16 where the build has the AVX512-BF16 kernel).
  Where it loses at every row count its panels are given back (:func:`release_panels`) unless
  the fused decode path, which reads every panel, won somewhere.
* ``decoder_pointwise`` against the torch ops ``model.py`` and ``rope.py`` fall back to: each
  op (RMSNorm, residual add + RMSNorm, q/k rotation, SiLU * up) at 1, 8, 64, 512 ... tokens.
* ``decode_layers`` (the fused decode path, :mod:`fused_decode`) against the same layers op by
  op, on the model itself at 1, 2, 4 and 8 rows of :data:`DECODE_CONTEXT` tokens, once the KV
  cache exists (:func:`choose_fused`, after the kernels it sequences were chosen).
* the attention kernels, and the grouped layout after a cached prefix
  (:mod:`edgeinfer.daemon.engine.attention_trials`).

A size between two measured ones runs the kernel only where both chose it (``SizeRoute``); the
timing itself, the margin and the cache are :mod:`edgeinfer.kernels.kernel_choice`'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from edgeinfer.daemon.engine.attention_metadata import AttentionMetadata
from edgeinfer.daemon.engine.attention_trials import DECODE_CONTEXT, attention_sets, grouped_sets
from edgeinfer.daemon.engine.fused_decode import FusedDecode
from edgeinfer.daemon.engine.kv_cache import KVCache
from edgeinfer.daemon.engine.linear import Linear, linear
from edgeinfer.daemon.engine.model import CausalLM, FusedProjection
from edgeinfer.daemon.engine.model_config import ModelConfig
from edgeinfer.daemon.engine.rope import Rotation
from edgeinfer.daemon.engine.trial_set import Setup, Sizes, TrialSet, dtype_name
from edgeinfer.kernels import decoder_pointwise, kernel_choice, native_build, skinny_gemm
from edgeinfer.kernels.kernel_choice import Chooser, SizeRoute, Trial, powers_of_two
from edgeinfer.kernels.skinny_gemm import SkinnyWeight

log = logging.getLogger(__name__)

SKINNY_ROWS = (1, 2, 4, 8)
BUDGET_S = 10.0  # timing per engine load, at most (SmolLM2 on 2 idle cores: ~3 s)


def projections(model: CausalLM) -> dict[tuple[int, int], list[tuple[Tensor, SkinnyWeight]]]:
    """The packed weights that also have ``skinny_gemm`` panels (not given back), by
    ``(out, in)``."""
    groups: dict[tuple[int, int], list[tuple[Tensor, SkinnyWeight]]] = {}
    for m in model.modules():
        packed = m.packed if isinstance(m, Linear) else getattr(m, "weight", None)
        skinny = m.skinny if isinstance(m, Linear | FusedProjection) else None
        if skinny is not None and packed is not None and skinny.panels.numel():
            groups.setdefault((skinny.out_features, skinny.in_features), []).append(
                (packed, skinny)
            )
    return groups


def skinny_sets(model: CausalLM, sizes: Sizes) -> list[TrialSet]:
    build = native_build.build_id("skinny_gemm")
    if build is None:
        return []
    sets = []
    for (out_f, in_f), pairs in projections(model).items():
        trials = []
        for rows in (r for r in SKINNY_ROWS if r <= min(sizes.max_num_seqs, pairs[0][1].max_rows)):

            def setup(rows: int = rows, in_f: int = in_f, pairs: list = pairs) -> tuple:
                x = torch.randn(rows, in_f).to(pairs[0][1].dtype)

                def onednn() -> None:
                    for packed, _ in pairs:
                        linear(x, packed)

                def skinny() -> None:
                    for _, panels in pairs:
                        skinny_gemm.skinny_linear(x, panels)

                return onednn, skinny

            case = f"{out_f}x{in_f} {pairs[0][1].label} x{len(pairs)}, {rows} rows"
            trials.append((rows, Trial("skinny_gemm", case, "oneDNN", build, setup), True))

        def apply(route: SizeRoute, pairs: list = pairs) -> None:
            for _, panels in pairs:
                panels.route = route  # lost everywhere: given back later (release_panels)

        if trials:
            sets.append(TrialSet("skinny_gemm", trials, apply))
    return sets


def _torch_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``RMSNorm.forward`` without the compiled op (model.py)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def _torch_silu_mul(gate_up: Tensor) -> Tensor:
    """``MLP.forward``'s SiLU * up without the compiled op (model.py)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def _pointwise_setup(cfg: ModelConfig, dtype: torch.dtype, op: str, tokens: int) -> Setup:
    """The op's torch formulation and the compiled one on ``tokens`` rows of this model."""

    def setup() -> tuple[Callable[[], object], Callable[[], object]]:
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        weight = (1 + 0.1 * torch.randn(hidden)).to(dtype)
        x, delta = torch.randn(tokens, hidden).to(dtype), torch.randn(tokens, hidden).to(dtype)
        if op == "rms_norm":
            return (
                lambda: _torch_norm(x, weight, eps),
                lambda: decoder_pointwise.rms_norm(x, weight, eps),
            )
        if op == "add_rms_norm":
            return (
                lambda: _torch_norm(x + delta, weight, eps),
                lambda: decoder_pointwise.add_rms_norm(x, delta, weight, eps),
            )
        if op == "rotate":
            rotated = cfg.num_heads + cfg.num_kv_heads
            qkv = torch.randn(tokens, rotated + cfg.num_kv_heads, cfg.head_dim).to(dtype)
            qk = qkv[:, :rotated]  # q and k of the fused projection's output, rotated in place
            angles = torch.rand(tokens, cfg.head_dim // 2) * 100
            emb = torch.cat((angles, angles), dim=-1)
            rot = Rotation.build(emb.cos(), emb.sin(), dtype)
            return (
                lambda: rot.apply(qk),
                lambda: decoder_pointwise.rotate_(qk, rot.cos, rot.signed_sin),
            )
        gate_up = torch.randn(tokens, 2 * cfg.intermediate_size).to(dtype)
        return lambda: _torch_silu_mul(gate_up), lambda: decoder_pointwise.silu_mul(gate_up)

    return setup


def pointwise_sets(cfg: ModelConfig, sizes: Sizes) -> list[TrialSet]:
    build = native_build.build_id("decoder_pointwise")
    dtype = sizes.dtype
    if build is None or not decoder_pointwise.supports(torch.empty(0, dtype=dtype)):
        return []
    width = {
        "rms_norm": f"{cfg.hidden_size}",
        "add_rms_norm": f"{cfg.hidden_size}",
        "rotate": f"{cfg.num_heads + cfg.num_kv_heads}x{cfg.head_dim}",
        "silu_mul": f"{2 * cfg.intermediate_size}",
    }
    sets = []
    for op in decoder_pointwise.OPS:
        trials = []
        for tokens in powers_of_two(sizes.max_tokens, step=3):
            case = f"{op} {width[op]} {dtype_name(dtype)}, {tokens} tokens"
            setup = _pointwise_setup(cfg, dtype, op, tokens)
            trial = Trial("decoder_pointwise", case, "torch ops", build, setup)
            trials.append((tokens, trial, tokens <= sizes.max_num_seqs))

        def apply(route: SizeRoute, op: str = op) -> None:
            decoder_pointwise.set_route(op, dtype, route)

        sets.append(TrialSet("decoder_pointwise", trials, apply))
    return sets


def trial_sets(model: CausalLM, sizes: Sizes) -> list[TrialSet]:
    """Every kernel trial of this model (none where the libraries did not build), the cheap
    ones first: where the time budget runs out, the costliest to time keep their baselines."""
    return (
        pointwise_sets(model.config, sizes)
        + attention_sets(model.config, sizes)
        + skinny_sets(model, sizes)
        # Last: its 1,024-token case is the dearest to time, and untimed it changes nothing.
        + grouped_sets(model.config, sizes)
    )


def choose_kernels(model: CausalLM, sizes: Sizes, threads: tuple[int, int]) -> None:
    """Time every trial (or read it from the cache) and route each kernel accordingly; logs
    what was chosen. ``threads``: torch threads of (decode-only steps, steps with prefill).
    Past :data:`BUDGET_S` of timing (a host busy with other work) the kernels not yet timed
    keep their baselines."""
    if kernel_choice.mode() == "off" or not native_build.enabled():
        return
    start = time.perf_counter()
    decode = Chooser(threads[0])
    prefill = decode if threads[1] == threads[0] else Chooser(threads[1])
    choosers = [decode] if prefill is decode else [decode, prefill]
    skipped = []
    for s in trial_sets(model, sizes):
        if sum(c.measured_s for c in choosers) > BUDGET_S:
            s.apply(SizeRoute({1: False}))
            skipped.append(s.trials[0][1].case)
            continue
        try:
            verdicts = {
                size: (decode if at_decode else prefill).decide(trial).chosen
                for size, trial, at_decode in s.trials
            }
        except (RuntimeError, ValueError) as exc:  # a kernel that fails on this model's shapes
            log.warning("%s failed its trial, its baseline runs: %s", s.kernel, exc)
            verdicts = {1: False}
        s.apply(SizeRoute(verdicts))
    for chooser in choosers:
        chooser.save()
    if skipped:
        log.warning(
            "kernel timing ran past %.0f s (a busy host?): baselines kept, untimed, for %s",
            BUDGET_S,
            "; ".join(skipped),
        )
    log.info(
        "compiled kernels chosen by measurement (%.1f s timing, %.1f s in all): %s",
        sum(c.measured_s for c in choosers),
        time.perf_counter() - start,
        kernel_choice.describe() or "none built",
    )


def _fused_setup(model: CausalLM, fused: FusedDecode, kv_cache: KVCache, rows: int) -> Setup:
    def setup() -> tuple[Callable[[], object], Callable[[], object]]:
        # rows sequences of DECODE_CONTEXT tokens in the first blocks of the (still unused)
        # cache: what they write there is overwritten by the prefills that later own them.
        page = kv_cache.layout.block_size
        per_seq = -(-DECODE_CONTEXT // page)
        if rows * per_seq > kv_cache.num_blocks:
            raise ValueError(f"{rows} sequences of {DECODE_CONTEXT} tokens overflow the cache")
        tables = torch.arange(rows * per_seq, dtype=torch.int32).view(rows, per_seq)
        last = DECODE_CONTEXT - 1
        meta = AttentionMetadata(
            slot_mapping=(tables[:, last // page] * page + last % page).to(torch.int64),
            num_decode_tokens=rows,
            decode_block_tables=tables,
            decode_context_lens=torch.full((rows,), DECODE_CONTEXT, dtype=torch.int32),
            decode_in_place=True,
        )
        ids = torch.randint(model.config.vocab_size, (rows,))
        x0 = model.model.embed_tokens(ids)
        cos, sin = model.rotary_emb(torch.full((rows,), last), last)
        rot = Rotation.build(cos, sin, x0.dtype)
        x = x0.clone()
        if not fused.runs(x, meta):
            raise ValueError(f"a kernel the fused path sequences does not run at {rows} rows")

        def op_by_op() -> None:
            y = x.copy_(x0)
            for i, layer in enumerate(model.model.layers):
                y = layer(y, rot, meta, kv_cache.k[i], kv_cache.v[i])

        def fused_step() -> None:
            fused(x.copy_(x0), rot, meta)

        return op_by_op, fused_step

    return setup


def fused_trials(
    model: CausalLM, fused: FusedDecode, kv_cache: KVCache, sizes: Sizes
) -> list[tuple[int, Trial]]:
    """The fused decode path's trials, by rows; none where its library did not build."""
    build = native_build.build_id("decode_layers")
    if build is None:
        return []
    name = f"{model.config.num_layers} layers {dtype_name(fused.dtype)}"
    return [
        (rows, Trial(
            "decode_layers", f"{name}, {rows} rows of {DECODE_CONTEXT} tokens", "op by op",
            build, _fused_setup(model, fused, kv_cache, rows),
        ))
        for rows in SKINNY_ROWS
        if rows <= min(sizes.max_num_seqs, skinny_gemm.max_rows())
    ]  # fmt: skip


def choose_fused(
    model: CausalLM, fused: FusedDecode, kv_cache: KVCache, sizes: Sizes, threads: int
) -> None:
    """Time the fused decode path against the op-by-op layers (at ``threads``, the decode
    steps' torch threads) and set where it runs; a row count where it could not be timed, or
    did not win, keeps the layers op by op."""
    if kernel_choice.mode() == "off" or not native_build.enabled():
        return
    chooser = Chooser(threads)
    verdicts, ratios = {}, []
    for rows, trial in fused_trials(model, fused, kv_cache, sizes):
        try:
            verdict = chooser.decide(trial)
            verdicts[rows] = verdict.chosen
            ratios.append(f"{rows} rows {verdict.timing.ratio:.2f}x")
        except ValueError as exc:
            log.info("fused decode not timed at %d rows: %s", rows, exc)
            verdicts[rows] = False
    chooser.save()
    fused.set_route(SizeRoute(verdicts or {1: False}))
    log.info(
        "fused decode layers against op by op (runs at >= %.2fx): %s",
        kernel_choice.MARGIN,
        ", ".join(ratios) or "not timed",
    )


def release_panels(model: CausalLM, fused: FusedDecode | None) -> None:
    """Give back the panels of every weight whose skinny GEMM lost at every row count, unless
    ``fused`` runs at some row count (it reads every panel: the trial that chose it timed
    them). Call once the fused path's trial is done (or where there is none)."""
    if fused is not None and (fused.route is None or not fused.route.never):
        return
    for weights in projections(model).values():
        for _, panels in weights:
            if panels.route is not None and panels.route.never:
                panels.retire()
