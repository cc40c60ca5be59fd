"""Compiled CPU kernels chosen by measurement: the logic, never this host's speed.

A kernel made slow on purpose (a sleep) is not chosen and one whose baseline is made slow is;
a cached timing is reused without measuring; the cache key follows the CPU, the build and
torch; the engine routes every kernel by its verdicts and still generates HF's tokens.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from daemon_helpers import daemon_config, start
from edgeinfer.daemon.engine import (
    attention_trials,
    cpu_attention,
    kernel_trials,
    model_runner,
    trial_set,
)
from edgeinfer.daemon.engine import linear as linear_module
from edgeinfer.daemon.engine.config import EngineConfig
from edgeinfer.daemon.engine.llm_engine import LLMEngine
from edgeinfer.daemon.engine.model import CausalLM
from edgeinfer.daemon.engine.model_config import ModelConfig
from edgeinfer.daemon.engine.sampling_params import SamplingParams
from edgeinfer.daemon.engine.tiny_checkpoint import build_tiny_checkpoint
from edgeinfer.kernels import decoder_pointwise, kernel_choice, skinny_gemm
from edgeinfer.kernels import paged_attention_native as native
from edgeinfer.kernels.kernel_choice import Chooser, SizeRoute, Trial
from engine_helpers import assert_matches, hf_greedy, random_prompts
from native_helpers import require_native

SLOW_S = 0.002  # what "slow on purpose" sleeps per call: far beyond any margin


def idle() -> None:
    """A call that costs next to nothing."""


def slow() -> None:
    time.sleep(SLOW_S)


def trial(kernel: Any = idle, baseline: Any = slow, *, build: str = "lib-1", case: str = "c"):
    return Trial("lib", case, "library", build, lambda: (baseline, kernel))


@pytest.fixture(autouse=True)
def quiet(monkeypatch, tmp_path):
    """A private cache, a host that reads as quiet, no verdicts or routes left behind."""
    monkeypatch.setenv("EDGEINFER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(kernel_choice, "host_busy", lambda: False)
    yield
    kernel_choice.clear()
    decoder_pointwise._routes.clear()
    cpu_attention._decode_routes.clear()
    cpu_attention._prefill_routes.clear()


def test_size_route_runs_the_kernel_only_where_it_won_on_both_sides():
    route = SizeRoute({1: True, 2: True, 4: True, 8: False})
    assert [route(n) for n in range(1, 10)] == [True] * 4 + [False] * 5  # 5-7: 4 won, 8 lost
    route = SizeRoute({16: False, 64: True, 256: True})
    assert [route(n) for n in (1, 16, 17, 63, 64, 100, 256, 10**6)] == [False] * 4 + [True] * 4
    assert SizeRoute({1: False}).never and not route.never
    with pytest.raises(ValueError, match=">= 1"):
        SizeRoute({0: True})


def test_a_kernel_slow_on_purpose_is_not_chosen(tmp_path):
    verdict = Chooser(1, path=tmp_path / "c.json").decide(trial(kernel=slow, baseline=idle))
    assert not verdict.chosen and verdict.timing.ratio < 1 and not verdict.cached


def test_a_kernel_whose_baseline_is_slow_is_chosen(tmp_path):
    verdict = Chooser(1, path=tmp_path / "c.json").decide(trial())
    assert verdict.chosen and verdict.timing.ratio >= kernel_choice.MARGIN


def test_a_cached_choice_is_reused_without_measuring(tmp_path):
    path = tmp_path / "c.json"
    first = Chooser(1, path=path)
    measured = first.decide(trial())
    first.save()

    def never() -> None:
        raise AssertionError("measured again")

    again = Chooser(1, path=path).decide(trial(kernel=never, baseline=never))
    assert again.cached and again.timing == measured.timing and again.chosen
    # Another thread count is another measurement.
    with pytest.raises(AssertionError, match="measured again"):
        Chooser(2, path=path).decide(trial(kernel=never, baseline=never))


def test_remeasure_ignores_the_cache(tmp_path, monkeypatch):
    path = tmp_path / "c.json"
    chooser = Chooser(1, path=path)
    chooser.decide(trial())
    chooser.save()
    monkeypatch.setenv(kernel_choice.ENV_MODE, "remeasure")
    assert not Chooser(1, path=path).decide(trial(kernel=slow, baseline=idle)).chosen
    monkeypatch.setenv(kernel_choice.ENV_MODE, "sometimes")
    with pytest.raises(ValueError, match="EDGEINFER_KERNEL_CHOICE"):
        kernel_choice.mode()


def test_a_timing_taken_on_a_busy_host_is_measured_again_once_it_is_quiet(tmp_path, monkeypatch):
    path = tmp_path / "c.json"
    calls = []

    def counted() -> None:
        calls.append(1)

    monkeypatch.setattr(kernel_choice, "host_busy", lambda: True)
    busy = Chooser(1, path=path)
    busy.decide(trial(kernel=counted))
    busy.save()
    measured = len(calls)
    assert Chooser(1, path=path).decide(trial(kernel=counted)).cached  # still busy: reused
    assert len(calls) == measured
    monkeypatch.setattr(kernel_choice, "host_busy", lambda: False)
    assert not Chooser(1, path=path).decide(trial(kernel=counted)).cached
    assert len(calls) > measured


def test_the_cache_key_follows_the_cpu_the_build_and_torch(tmp_path, monkeypatch):
    base = kernel_choice.cache_path()
    monkeypatch.setattr(kernel_choice, "_cpu_identity", lambda: "model name: other\nflags: avx2")
    other_cpu = kernel_choice.cache_path()
    monkeypatch.setattr(torch, "__version__", "0.0.0-other")
    other_torch = kernel_choice.cache_path()
    assert len({base, other_cpu, other_torch}) == 3
    assert base.parent == Path(tmp_path / "cache" / "kernel_choice")
    chooser = Chooser(1, path=tmp_path / "c.json")
    chooser.decide(trial())
    assert chooser.decide(trial()).cached
    assert not chooser.decide(trial(build="lib-2")).cached  # a rebuilt kernel: measured again


def test_summary_says_what_was_chosen_and_by_how_much(tmp_path):
    chooser = Chooser(1, path=tmp_path / "c.json")
    chooser.decide(trial(case="won"))
    chooser.decide(trial(kernel=slow, baseline=idle, case="lost"))
    entry = kernel_choice.summary()["lib"]
    assert entry["baseline"] == "library" and entry["margin"] == kernel_choice.MARGIN
    assert set(entry["chosen"]) == {"won"} and entry["chosen"]["won"] >= kernel_choice.MARGIN
    assert set(entry["kept_baseline"]) == {"lost"} and entry["kept_baseline"]["lost"] < 1
    assert "lib: runs in 1 of 2 cases" in kernel_choice.describe()


def _slowed(fn: Any) -> Any:
    """``fn`` doing its work 20 times over: slower than its rival in any weather (a sleep
    would not be: on a loaded host a two-thread library call can wait longer for a core)."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        for _ in range(19):
            fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper


@pytest.fixture
def keep_threads():
    """Torch's thread count as it was (an engine with ``num_threads`` sets it process-wide)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_the_engine_routes_each_kernel_by_its_verdicts(tmp_path, monkeypatch, keep_threads):
    require_native(*("skinny_gemm", "decoder_pointwise"))
    require_native("paged_decode_attention", "paged_prefill_attention")
    # The tiny checkpoint's weights pack (and get panels) once the size floor is lifted.
    monkeypatch.setattr(linear_module, "ONEDNN_MIN_FLOAT32_WEIGHT", 0)
    # Slow on purpose: skinny_gemm, the compiled SiLU * up, the compiled decode attention;
    # and the baseline of prefill attention (torch's), so that kernel wins everywhere.
    monkeypatch.setattr(skinny_gemm, "skinny_linear", _slowed(skinny_gemm.skinny_linear))
    monkeypatch.setattr(decoder_pointwise, "silu_mul", _slowed(decoder_pointwise.silu_mul))
    monkeypatch.setattr(native.PreparedDecode, "__call__", _slowed(native.PreparedDecode.__call__))
    monkeypatch.setattr(
        attention_trials, "prefill_attention_cpu", _slowed(attention_trials.prefill_attention_cpu)
    )
    # And the fused decode path loses everywhere, which would otherwise keep every panel for
    # itself. Its verdict is given, not timed (test_fused_decode times it): on this tiny model a
    # 20-fold slowed compiled call is close to the layers' per-op Python, and a loaded host
    # has let it win a row count.
    monkeypatch.setattr(
        model_runner,
        "choose_fused",
        lambda model, fused, *_: fused.set_route(SizeRoute({1: False})),
    )
    path = build_tiny_checkpoint(tmp_path / "ckpt")
    # One thread: a two-thread call on a loaded host can wait a whole scheduler slice for its
    # second thread, which even a 20-fold slowdown of the other side need not outweigh.
    config = EngineConfig(model=str(path), max_num_seqs=8, max_num_batched_tokens=256)
    engine = LLMEngine(dataclasses.replace(config, num_threads=1))
    model = engine.runner.model
    panels = [m.skinny for m in model.modules() if getattr(m, "skinny", None) is not None]
    assert panels and all(w.route is not None and w.route.never for w in panels)
    assert kernel_trials.projections(model) == {}  # none left to time or to run
    assert all(w.panels.numel() == 0 for w in panels)  # the lost copies' memory given back
    assert all(not w.runs(rows) for w in panels for rows in range(1, 9))
    dtype = engine.runner.dtype
    for tokens in (1, 5, 64, 256):
        assert not decoder_pointwise.runs("silu_mul", torch.zeros(tokens, 8, dtype=dtype))
        q, k_cache = torch.zeros(tokens, 4, 16, dtype=dtype), torch.zeros(1, 16, 2, 16, dtype=dtype)
        assert cpu_attention.prefill_in_place(q, k_cache)
    # Narrow KV heads (2 x 16): without the compiled kernel, decode takes torch's plan.
    values = 2 * 2 * 16
    assert not any(cpu_attention.decode_in_place(dtype, values, b) for b in (1, 3, 8))
    summary = kernel_choice.summary()
    assert summary["skinny_gemm"]["chosen"] == {}
    assert summary["paged_decode_attention"]["chosen"] == {}
    assert summary["paged_prefill_attention"]["kept_baseline"] == {}
    # Every route at once still generates transformers' tokens.
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = random_prompts(4, hf.config.vocab_size, max_len=100, seed=5)
    params = SamplingParams(max_tokens=6, min_tokens=6, temperature=0.0)
    with torch.inference_mode():
        for i, (prompt, out) in enumerate(zip(prompts, engine.generate(prompts, params))):
            assert_matches(out.token_ids, hf_greedy(hf, prompt, 6), f"prompt {i}")


def test_off_switch_measures_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(kernel_choice.ENV_MODE, "off")
    monkeypatch.setattr(kernel_choice, "measure", None)  # would raise if called
    path = build_tiny_checkpoint(tmp_path / "ckpt")
    LLMEngine(EngineConfig(model=str(path)))
    assert kernel_choice.verdicts() == []


@pytest.mark.asyncio
async def test_state_reports_the_choices(aiohttp_client: Any, tmp_path: Path) -> None:
    path = build_tiny_checkpoint(tmp_path / "ckpt")
    llm = LLMEngine(EngineConfig(model=str(path), max_num_seqs=4, max_num_batched_tokens=64))
    client = await start(aiohttp_client, daemon_config(path), llm)
    state = await (await client.get("/v1/state")).json()
    assert state["kernels"] == kernel_choice.summary()
    if kernel_choice.verdicts():  # a host with a compiler measured something
        entry = next(iter(state["kernels"].values()))
        assert {"baseline", "margin", "chosen", "kept_baseline"} <= set(entry)


def test_bf16_projections_are_timed_in_bf16_and_a_slowed_kernel_is_not_chosen(
    tmp_path, monkeypatch
):
    require_native("skinny_gemm")
    if not skinny_gemm.takes_bf16() or not linear_module.can_pack(
        torch.ones(1, dtype=torch.bfloat16)
    ):
        pytest.skip("no AVX512-BF16 kernel (or no bf16 oneDNN) here: bf16 stays on oneDNN")
    cfg = ModelConfig.from_dict(
        {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96}
        | {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
        | {"vocab_size": 300, "max_position_embeddings": 256, "rms_norm_eps": 1e-5}
    )
    model = CausalLM(cfg).to(torch.bfloat16)
    model.fuse_projections()
    model.pack_weights()
    groups = kernel_trials.projections(model)
    assert groups and all(w.panels.dtype == torch.bfloat16 for g in groups.values() for _, w in g)
    monkeypatch.setattr(skinny_gemm, "skinny_linear", _slowed(skinny_gemm.skinny_linear))
    sizes = trial_set.Sizes(torch.bfloat16, block_size=16, max_num_seqs=8, max_tokens=64)
    chooser = Chooser(1, path=tmp_path / "c.json")
    sets = kernel_trials.skinny_sets(model, sizes)
    assert len(sets) == len(groups)
    for s in sets:
        assert all("bfloat16" in t.case for _, t, _ in s.trials)
        s.apply(SizeRoute({size: chooser.decide(t).chosen for size, t, _ in s.trials}))
    kernel_trials.release_panels(model, None)
    assert kernel_trials.projections(model) == {}  # every bf16 copy lost, its panels given back


def test_grouped_prefill_is_timed_after_a_prefix_and_routes_by_chunk(tmp_path, monkeypatch):
    """The grouped layout's trials attend chunks after PREFIX_CONTEXT cached tokens; their
    verdicts route chunks after a prefix by size, and a cache without a route repeats heads."""
    cfg = ModelConfig.from_dict(
        {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96}
        | {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
        | {"vocab_size": 300, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}
    )
    sizes = trial_set.Sizes(torch.float32, block_size=16, max_num_seqs=8, max_tokens=2048)
    (grouped,) = attention_trials.grouped_sets(cfg, sizes)
    assert [size for size, _, _ in grouped.trials] == [16, 64, 256, 1024]
    assert all(f"after {attention_trials.PREFIX_CONTEXT}" in t.case for _, t, _ in grouped.trials)
    # What each trial times computes the same attention both ways.
    baseline, kernel = grouped.trials[0][1].setup()
    torch.testing.assert_close(kernel(), baseline())
    q, k_cache = torch.zeros(100, 4, 16), torch.zeros(1, 16, 2, 16)
    assert not cpu_attention.prefill_grouped(q, k_cache)  # never timed: heads repeated
    try:
        grouped.apply(SizeRoute({16: True, 64: True, 256: False, 1024: False}))
        assert cpu_attention.prefill_grouped(q[:64], k_cache)
        assert not cpu_attention.prefill_grouped(q[:100], k_cache)
    finally:
        cpu_attention.set_grouped_route(torch.float32, 2 * 2 * 16, None)
    # Nothing to group where each KV head has one query head.
    mha = dataclasses.replace(cfg, num_kv_heads=4)
    assert attention_trials.grouped_sets(mha, sizes) == []
