"""What each rank of a ``tensor_parallel x pipeline_parallel`` engine owns.

Ranks are numbered stage-major: rank ``stage * tp + tp_rank``. Within a stage, rank ``t`` owns
query heads ``[t * H/tp, (t+1) * H/tp)``, the KV heads those queries read (a replica when there
are fewer KV heads than ranks), the ``t``-th slice of the MLP's intermediate dimension and a
``ceil(V/tp)`` slice of the vocabulary (the last one padded). A stage owns a contiguous run of
layers, earlier stages one more when the layers do not split evenly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from edgeinfer.daemon.engine.errors import EngineError
from edgeinfer.daemon.engine.model_config import ModelConfig


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1:
            raise EngineError(
                f"tensor_parallel and pipeline_parallel must be >= 1, got {self.tp} and {self.pp}"
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    def rank_of(self, stage: int, tp_rank: int) -> int:
        return stage * self.tp + tp_rank

    def coords(self, rank: int) -> tuple[int, int]:
        """``(stage, tp_rank)`` of a global rank."""
        return divmod(rank, self.tp)

    def validate(self, cfg: ModelConfig) -> None:
        """Refuse a layout that does not divide the model, naming the numbers."""
        tp, pp = self.tp, self.pp
        if cfg.num_heads % tp:
            raise EngineError(
                f"tensor_parallel={tp} does not divide num_attention_heads={cfg.num_heads}"
            )
        kv = cfg.num_kv_heads
        if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
            raise EngineError(
                f"tensor_parallel={tp} must divide num_key_value_heads={kv} or be a multiple "
                "of it (fewer KV heads than ranks are replicated)"
            )
        if cfg.intermediate_size % tp:
            raise EngineError(
                f"tensor_parallel={tp} does not divide intermediate_size={cfg.intermediate_size}"
            )
        if pp > cfg.num_layers:
            raise EngineError(
                f"pipeline_parallel={pp} exceeds num_hidden_layers={cfg.num_layers}: "
                "every stage needs at least one layer"
            )

    # ---- what one rank owns ----------------------------------------------------------------
    def stage_layers(self, stage: int, num_layers: int) -> range:
        base, extra = divmod(num_layers, self.pp)
        start = stage * base + min(stage, extra)
        return range(start, start + base + (stage < extra))

    def stage_of(self, layer: int, num_layers: int) -> int:
        return next(s for s in range(self.pp) if layer in self.stage_layers(s, num_layers))

    def heads(self, tp_rank: int, cfg: ModelConfig) -> range:
        n = cfg.num_heads // self.tp
        return range(tp_rank * n, (tp_rank + 1) * n)

    def kv_heads(self, tp_rank: int, cfg: ModelConfig) -> range:
        kv = cfg.num_kv_heads
        if kv < self.tp:
            # tp / kv ranks share one KV head: the one their query heads are grouped onto.
            head = tp_rank * kv // self.tp
            return range(head, head + 1)
        n = kv // self.tp
        return range(tp_rank * n, (tp_rank + 1) * n)

    def kv_primary(self, tp_rank: int, cfg: ModelConfig) -> bool:
        """Whether ``tp_rank`` holds the first copy of its KV heads (the one that is exported)."""
        kv = cfg.num_kv_heads
        return kv >= self.tp or tp_rank % (self.tp // kv) == 0

    def intermediate(self, tp_rank: int, cfg: ModelConfig) -> range:
        n = cfg.intermediate_size // self.tp
        return range(tp_rank * n, (tp_rank + 1) * n)

    def vocab_shard(self, vocab_size: int) -> int:
        """Rows of every rank's vocabulary slice (the last slice is zero-padded up to it)."""
        return -(-vocab_size // self.tp)

    def vocab(self, tp_rank: int, vocab_size: int) -> range:
        per = self.vocab_shard(vocab_size)
        return range(min(tp_rank * per, vocab_size), min((tp_rank + 1) * per, vocab_size))

    def shard_config(self, tp_rank: int, cfg: ModelConfig) -> ModelConfig:
        """The config whose plain modules have exactly the shapes of this rank's shards."""
        return dataclasses.replace(
            cfg,
            vocab_size=self.vocab_shard(cfg.vocab_size),
            num_heads=cfg.num_heads // self.tp,
            num_kv_heads=len(self.kv_heads(tp_rank, cfg)),
            intermediate_size=cfg.intermediate_size // self.tp,
        )
