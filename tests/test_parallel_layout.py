"""What each rank owns, and the layouts that are refused at start (issue: parallel)."""

from __future__ import annotations

import dataclasses
import math
import os
import signal
from pathlib import Path

import pytest
import torch
from torch.distributed import HashStore

from edgeinfer.daemon.engine.checkpoint import CheckpointReader
from edgeinfer.daemon.engine.config import EngineConfig
from edgeinfer.daemon.engine.errors import EngineError
from edgeinfer.daemon.engine.llm_engine import LLMEngine
from edgeinfer.daemon.engine.model_config import ModelConfig
from edgeinfer.daemon.engine.parallel.comm import Comm
from edgeinfer.daemon.engine.parallel.executor import ParallelExecutor
from edgeinfer.daemon.engine.parallel.layout import ParallelLayout
from edgeinfer.daemon.engine.parallel.pp import split_entries
from edgeinfer.daemon.engine.parallel.progress import StoreProgress
from edgeinfer.daemon.engine.parallel.tp import build_shard, load_shard
from edgeinfer.daemon.engine.tiny_checkpoint import build_tiny_checkpoint
from parallel_helpers import GREEDY, PROMPTS, engine_config

CFG = ModelConfig.from_dict(
    {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 513,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 5,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
    }
)


def test_ownership_of_heads_vocab_and_layers() -> None:
    four = ParallelLayout(tp=4, pp=2)
    assert [four.heads(t, CFG) for t in range(4)] == [
        range(0, 2),
        range(2, 4),
        range(4, 6),
        range(6, 8),
    ]
    # Two KV heads over four ranks: each is replicated on the two ranks whose queries use it.
    assert [four.kv_heads(t, CFG) for t in range(4)] == [
        range(0, 1),
        range(0, 1),
        range(1, 2),
        range(1, 2),
    ]
    assert [four.kv_primary(t, CFG) for t in range(4)] == [True, False, True, False]
    # 513 rows: slices of 129, the last one 126 real rows (padded on the rank).
    assert four.vocab_shard(513) == 129
    assert four.vocab(3, 513) == range(387, 513)
    assert [four.stage_layers(s, 5) for s in range(2)] == [range(0, 3), range(3, 5)]
    assert four.coords(six := four.rank_of(1, 2)) == (1, 2) and six == 6
    shard = ParallelLayout(tp=2).shard_config(1, CFG)
    assert (shard.num_heads, shard.num_kv_heads, shard.intermediate_size) == (4, 1, 64)


@pytest.mark.parametrize(
    "change,tp,pp,message",
    [
        ({"num_heads": 9, "num_kv_heads": 3}, 2, 1, "tensor_parallel=2 does not divide num_attention_heads=9"),
        ({"num_kv_heads": 2}, 3, 1, "num_attention_heads=8"),
        ({"num_heads": 6, "num_kv_heads": 3}, 2, 1, "num_key_value_heads=3"),
        ({"intermediate_size": 100}, 8, 1, "intermediate_size=100"),
        ({}, 1, 6, "pipeline_parallel=6 exceeds num_hidden_layers=5"),
    ],
)  # fmt: skip
def test_layouts_that_do_not_divide_the_model(change, tp, pp, message) -> None:
    with pytest.raises(EngineError, match=message):
        ParallelLayout(tp, pp).validate(dataclasses.replace(CFG, **change))


def test_engine_config_refuses_zero_ranks() -> None:
    with pytest.raises(EngineError, match="tensor_parallel must be >= 1, got 0"):
        EngineConfig(tensor_parallel=0)


def test_engine_refuses_nine_heads_at_tp2_before_starting_workers(tmp_path: Path) -> None:
    ckpt = build_tiny_checkpoint(tmp_path / "m", hidden_size=72, num_heads=9, num_kv_heads=3)
    with pytest.raises(
        EngineError, match="tensor_parallel=2 does not divide num_attention_heads=9"
    ):
        LLMEngine(engine_config(ckpt, tp=2))


def test_micro_batches_are_contiguous_and_balanced() -> None:
    entries = [(object(), n) for n in (1, 1, 1, 60, 1)]
    groups = split_entries(entries, 2)  # type: ignore[arg-type]
    assert [[n for _, n in g] for g in groups] == [[1, 1, 1, 60], [1]]
    assert len(split_entries(entries[:1], 4)) == 1  # type: ignore[arg-type]
    assert [len(g) for g in split_entries(entries, 5)] == [1] * 5  # type: ignore[arg-type]


@pytest.mark.slow
def test_killed_rank_fails_the_engine_quickly(tmp_path: Path) -> None:
    ckpt = build_tiny_checkpoint(tmp_path / "m")
    engine = LLMEngine(engine_config(ckpt, tp=2))
    runner = engine.runner
    assert isinstance(runner, ParallelExecutor)
    try:
        assert [c.token_ids for c in engine.generate(PROMPTS[:2], GREEDY)]
        os.kill(runner.worker_pids[0], signal.SIGKILL)
        # Quickly: from the rank's death, which the error names, not a collective's timeout.
        with pytest.raises(EngineError, match=r"rank 1 .* exited with code -9"):
            engine.generate(PROMPTS[:2], GREEDY)
        with pytest.raises(EngineError, match="rank 1"):
            engine.check_health()
    finally:
        runner.close()


class CountingReader(CheckpointReader):
    """Counts the bytes handed out: whole tensors by name, slices in one sum."""

    def __init__(self, model_dir: Path) -> None:
        super().__init__(model_dir)
        self.whole: dict[str, int] = {}
        self.sliced = 0

    def get(self, name: str) -> torch.Tensor:
        t = super().get(name)
        self.whole[name] = t.numel() * t.element_size()
        return t

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        t = super().get_slice(name, dim, start, stop)
        self.sliced += t.numel() * t.element_size()
        return t


def test_a_rank_reads_only_its_slices(tmp_path: Path) -> None:
    ckpt = build_tiny_checkpoint(tmp_path / "m")  # untied: embedding and LM head both split
    cfg = ModelConfig.from_dir(ckpt)
    layout, cpu = ParallelLayout(tp=2), torch.device("cpu")
    model = build_shard(cfg, layout, 1, Comm(layout, 1, cpu), cpu, torch.float32)
    progress = StoreProgress(HashStore())
    reader = CountingReader(ckpt)
    with reader:
        load_shard(model, reader, cfg, layout, 1, torch.float32, progress)
        total = sum(4 * math.prod(reader.shape(n)) for n in reader.names())  # float32
    # Only the norm gains are read whole (replicated); every matrix is sliced.
    assert reader.whole and all(n.endswith("norm.weight") for n in reader.whole)
    assert 0.45 * total < reader.sliced + sum(reader.whole.values()) < 0.55 * total
    n = len(list(model.parameters()))
    assert progress.counts() == (n, n, 1)
