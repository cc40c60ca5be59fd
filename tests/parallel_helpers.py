"""Shared setup for the parallel-engine tests: tiny checkpoints, engines cached per module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from edgeinfer.daemon.engine.config import EngineConfig
from edgeinfer.daemon.engine.llm_engine import LLMEngine
from edgeinfer.daemon.engine.parallel.executor import ParallelExecutor
from edgeinfer.daemon.engine.sampling_params import SamplingParams
from engine_helpers import make_checkpoint, random_prompts

# (tensor_parallel, pipeline_parallel) layouts every test runs against one process.
LAYOUTS = [(2, 1), (1, 2), (2, 2)]
ARCHS = ("LlamaForCausalLM", "Qwen3ForCausalLM")
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
# Long prompts with a 64-token step budget: chunked prefill next to decodes in one step.
PROMPTS = random_prompts(6, 512, min_len=1, max_len=150, seed=3)


def engine_config(checkpoint: Path, tp: int = 1, pp: int = 1) -> EngineConfig:
    return EngineConfig(
        model=str(checkpoint),
        device="cpu",
        num_kv_blocks=128,
        max_model_len=512,
        max_num_batched_tokens=64,
        tensor_parallel=tp,
        pipeline_parallel=pp,
    )


class Engines:
    """Checkpoints and engines built on first use and kept for the module: each parallel
    engine starts worker processes, which is the slow part of these tests."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._checkpoints: dict[tuple[str, int], Path] = {}
        self._engines: dict[tuple[str, int, int, int], LLMEngine] = {}

    def checkpoint(self, arch: str, num_kv_heads: int = 2) -> Path:
        key = (arch, num_kv_heads)
        if key not in self._checkpoints:
            root = self.root / f"kv{num_kv_heads}"
            self._checkpoints[key] = make_checkpoint(root, arch, num_kv_heads=num_kv_heads)
        return self._checkpoints[key]

    def get(self, arch: str, tp: int = 1, pp: int = 1, num_kv_heads: int = 2) -> LLMEngine:
        key = (arch, tp, pp, num_kv_heads)
        if key not in self._engines:
            ckpt = self.checkpoint(arch, num_kv_heads)
            self._engines[key] = LLMEngine(engine_config(ckpt, tp, pp))
        return self._engines[key]

    def close(self) -> None:
        for engine in self._engines.values():
            if isinstance(engine.runner, ParallelExecutor):
                engine.runner.close()


def engines_fixture(root: Path) -> Iterator[Engines]:
    engines = Engines(root)
    try:
        yield engines
    finally:
        engines.close()


def tokens(engine: LLMEngine, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return [c.token_ids for c in engine.generate(prompts, GREEDY)]
