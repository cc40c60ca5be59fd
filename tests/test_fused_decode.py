"""The fused decode path (issue 19): a small decode step's layers in one compiled call give
the op-by-op path's tokens bit for bit, and it runs only where every kernel it sequences does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from edgeinfer.daemon.engine import cpu_attention, kernel_trials
from edgeinfer.daemon.engine.config import EngineConfig
from edgeinfer.daemon.engine.fused_decode import FusedDecode
from edgeinfer.daemon.engine.llm_engine import LLMEngine
from edgeinfer.daemon.engine.model import DecoderLayer
from edgeinfer.daemon.engine.sampling_params import SamplingParams
from edgeinfer.daemon.engine.tiny_checkpoint import build_tiny_checkpoint
from edgeinfer.kernels import decode_layers, decoder_pointwise, kernel_choice, skinny_gemm
from edgeinfer.kernels.kernel_choice import SizeRoute
from engine_helpers import random_prompts
from native_helpers import require_native

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture
def every_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """No trial routes: each compiled kernel runs wherever it takes the tensors, on both paths
    (the op-by-op path then uses the same pointwise kernels the fused one always does)."""
    require_native("skinny_gemm", "decoder_pointwise", "paged_decode_attention", "decode_layers")
    monkeypatch.setenv(kernel_choice.ENV_MODE, "off")
    monkeypatch.setattr(decoder_pointwise, "_routes", {})
    monkeypatch.setattr(cpu_attention, "_decode_routes", {})
    monkeypatch.setattr(cpu_attention, "_prefill_routes", {})


def _engine(tmp_path: Path, name: str, **model: object) -> LLMEngine:
    # 256 wide: every float32 weight is large enough to pack, so each has skinny panels.
    ckpt = build_tiny_checkpoint(
        tmp_path / name, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, **model
    )
    return LLMEngine(EngineConfig(model=str(ckpt), num_threads=2))


def _count_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    rows: list[int] = []
    call = FusedDecode.__call__

    def counted(self: FusedDecode, x: torch.Tensor, *args: object) -> torch.Tensor:
        rows.append(x.shape[0])
        return call(self, x, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(FusedDecode, "__call__", counted)
    return rows


@pytest.mark.parametrize("bias", [False, True], ids=["llama", "qwen2-bias"])
def test_fused_steps_give_the_op_by_op_tokens(
    tmp_path: Path, every_kernel: None, monkeypatch: pytest.MonkeyPatch, bias: bool
) -> None:
    arch = "Qwen2ForCausalLM" if bias else "LlamaForCausalLM"
    engine = _engine(tmp_path, arch, architecture=arch)
    model = engine.runner.model
    fused = model.fused_decode
    assert fused is not None
    rows = _count_calls(monkeypatch)
    prompts = random_prompts(skinny_gemm.max_rows(), 512, 3, 60, seed=4)
    for batch in (1, 3, skinny_gemm.max_rows()):
        # A first run caches the prompts, so the two compared runs prefill alike (the same
        # partial last block recomputed): only their decode steps differ.
        model.fused_decode = None
        engine.generate(prompts[:batch], GREEDY)
        model.fused_decode = fused
        got = [c.token_ids for c in engine.generate(prompts[:batch], GREEDY)]
        model.fused_decode = None
        want = [c.token_ids for c in engine.generate(prompts[:batch], GREEDY)]
        assert got == want, batch
        assert batch in rows  # the fused path really ran at this batch size


def test_a_float32_model_of_bf16_weights_fuses_on_halved_panels(
    tmp_path: Path, every_kernel: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A bf16 checkpoint served in float32 (a CPU without bf16 dot products): every projection's
    # panels are held in bf16 and the fused path calls the kernel that widens them.
    ckpt = build_tiny_checkpoint(
        tmp_path / "bf16", hidden_size=256, num_heads=4, num_kv_heads=2, dtype=torch.bfloat16
    )
    engine = LLMEngine(EngineConfig(model=str(ckpt), num_threads=2, dtype="float32"))
    model = engine.runner.model
    fused = model.fused_decode
    assert fused is not None and fused.dtype == torch.float32
    assert all(w.halved for w in fused._weights)
    rows = _count_calls(monkeypatch)
    prompts = random_prompts(3, 512, 3, 60, seed=6)
    model.fused_decode = None
    engine.generate(prompts, GREEDY)
    model.fused_decode = fused
    got = [c.token_ids for c in engine.generate(prompts, GREEDY)]
    model.fused_decode = None
    want = [c.token_ids for c in engine.generate(prompts, GREEDY)]
    assert got == want and 3 in rows
    # One layer's projection in float32 panels (a weight that was not bf16-exact): the fused
    # path, one GEMM entry for all, does not take the model; it does not fail to load either.
    old = model.model.layers[1].mlp.gate_up.skinny
    assert old is not None
    full = torch.ones(old.out_features, old.in_features)
    model.model.layers[1].mlp.gate_up.skinny = skinny_gemm.prepare(full, halve=False)
    assert FusedDecode.of(list(model.model.layers), engine.runner.kv_cache) is None


@pytest.mark.parametrize("refused_by", ["its trial", "given-back panels"])
def test_steps_the_fused_path_does_not_take(
    tmp_path: Path, every_kernel: None, monkeypatch: pytest.MonkeyPatch, refused_by: str
) -> None:
    engine = _engine(tmp_path, "m")
    fused = engine.runner.model.fused_decode
    assert fused is not None
    rows = _count_calls(monkeypatch)
    # A row count where the fused path lost its trial stays op by op; so does every step once
    # a projection's panels were given back (the skinny GEMM lost to oneDNN at every size).
    if refused_by == "its trial":
        fused.set_route(SizeRoute({1: True, 2: False}))
    else:
        fused._weights[-1].retire()
        fused.set_route(None)
    prompts = random_prompts(2, 512, 20, 40, seed=5)
    short = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.generate(prompts, [short, GREEDY])  # two rows, then one
    # Two rows never fused (one row neither, without the panels); prefill steps never are.
    assert set(rows) == ({1} if refused_by == "its trial" else set())


def test_models_the_fused_path_does_not_take(tmp_path: Path, every_kernel: None) -> None:
    # Qwen3's per-head q/k norms are not sequenced: the model keeps the op-by-op path.
    qwen3 = _engine(tmp_path, "q3", architecture="Qwen3ForCausalLM")
    assert qwen3.runner.model.fused_decode is None
    ckpt = build_tiny_checkpoint(tmp_path / "eager", hidden_size=256, num_heads=4)
    eager = LLMEngine(EngineConfig(model=str(ckpt), enforce_eager=True))
    assert eager.runner.model.fused_decode is None


def _slowed(fn: Any) -> Any:
    """``fn`` doing its work 20 times over: slower than its rival in any weather."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        for _ in range(19):
            fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper


@pytest.mark.parametrize("slowed", ["fused", "op by op"])
def test_the_trial_chooses_the_faster_path(
    tmp_path: Path, every_kernel: None, monkeypatch: pytest.MonkeyPatch, slowed: str
) -> None:
    engine = _engine(tmp_path, "m")
    runner = engine.runner
    fused = runner.model.fused_decode
    assert fused is not None
    monkeypatch.setenv("EDGEINFER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(kernel_choice.ENV_MODE, "remeasure")
    if slowed == "fused":
        monkeypatch.setattr(decode_layers, "run", _slowed(decode_layers.run))
    else:
        monkeypatch.setattr(DecoderLayer, "forward", _slowed(DecoderLayer.forward))
    # One thread: a two-thread call on a loaded host can wait a scheduler slice for its
    # second thread, which even a 20-fold slowdown of the other side need not outweigh.
    kernel_trials.choose_fused(
        runner.model, fused, runner.kv_cache, runner._sizes(engine.config), 1
    )
    sizes = [r for r in (1, 2, 4, 8) if r <= skinny_gemm.max_rows()]
    cases = {f"2 layers float32, {r} rows of {kernel_trials.DECODE_CONTEXT} tokens" for r in sizes}
    verdicts = kernel_choice.summary()["decode_layers"]
    chosen, lost = cases & set(verdicts["chosen"]), cases & set(verdicts["kept_baseline"])
    assert fused.route is not None
    if slowed == "fused":
        assert not chosen and lost == cases
        assert not any(fused.route(r) for r in sizes)
    else:
        assert chosen == cases and not lost
        assert all(fused.route(r) for r in sizes)
