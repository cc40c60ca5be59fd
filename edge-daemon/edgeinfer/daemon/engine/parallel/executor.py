"""The ``ModelRunner``-compatible front of a ``tensor_parallel x pipeline_parallel`` engine.

Lives in the engine's thread as rank 0: it flattens each batch into micro-batches on the host
(with a :class:`BatchBuilder`, as ``ModelRunner`` does), broadcasts them, runs its own shard
(stage 0, TP rank 0) and returns the logits that the last stage sends back. ``kv_cache`` and ``layout`` keep the
single-process meaning (all layers, all KV heads), so the engine's KV export/import and the
KV-transfer wire format are unchanged.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.distributed import TCPStore

from edgeinfer.daemon.engine.attention_backend import attention_backend
from edgeinfer.daemon.engine.batch_builder import BatchBuilder
from edgeinfer.daemon.engine.config import EngineConfig
from edgeinfer.daemon.engine.errors import EngineError
from edgeinfer.daemon.engine.kv_cache import KVLayout, num_blocks_for_budget
from edgeinfer.daemon.engine.model_config import ModelConfig
from edgeinfer.daemon.engine.parallel.comm import LOOPBACK, Comm
from edgeinfer.daemon.engine.parallel.kv import ShardedKVCache
from edgeinfer.daemon.engine.parallel.layout import ParallelLayout
from edgeinfer.daemon.engine.parallel.pp import MicroBatch, split_entries
from edgeinfer.daemon.engine.parallel.progress import LoadDisplay
from edgeinfer.daemon.engine.parallel.shard import (
    RankSpec,
    ShardRunner,
    rank_device,
    rank_kv_layout,
)
from edgeinfer.daemon.engine.parallel.worker import WorkerPool, cpu_threads
from edgeinfer.daemon.engine.scheduler import ScheduledBatch
from edgeinfer.daemon.engine.sequence import Sequence

log = logging.getLogger(__name__)


def _num_blocks(cfg: EngineConfig, model_cfg: ModelConfig, par: ParallelLayout) -> int:
    """Blocks every rank can hold: ``kv_cache_bytes`` is a per-rank (per-GPU) budget."""
    if cfg.num_kv_blocks:
        return cfg.num_kv_blocks
    dtype = cfg.resolve_dtype(model_cfg)
    fits = min(
        num_blocks_for_budget(
            rank_kv_layout(par, r, model_cfg, cfg.block_size, dtype), cfg.kv_cache_bytes
        )
        for r in range(par.world_size)
    )
    # The same cap as ModelRunner: more than every sequence at full context, twice over.
    max_len = cfg.resolve_max_model_len(model_cfg)
    return min(fits, 2 * cfg.max_num_seqs * -(-max_len // cfg.block_size))


class ParallelExecutor:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, model_dir: Path) -> None:
        par = ParallelLayout(cfg.tensor_parallel, cfg.pipeline_parallel)
        par.validate(model_cfg)
        if cfg.compressed_weights == "per_layer":
            raise EngineError(
                "compressed_weights=per_layer is not supported with tensor_parallel="
                f"{par.tp} x pipeline_parallel={par.pp}; use decompress_at_load"
            )
        self.device = rank_device(cfg, 0)
        if self.device.type == "cuda" and torch.cuda.device_count() < par.world_size:
            raise EngineError(
                f"tensor_parallel={par.tp} x pipeline_parallel={par.pp} needs "
                f"{par.world_size} GPUs, found {torch.cuda.device_count()}"
            )
        self.dtype = cfg.resolve_dtype(model_cfg)
        self.model_cfg = model_cfg
        self.block_size = cfg.block_size
        self.layout = KVLayout(
            num_layers=model_cfg.num_layers,
            block_size=cfg.block_size,
            num_kv_heads=model_cfg.num_kv_heads,
            head_dim=model_cfg.head_dim,
            dtype=self.dtype,
        )
        # One micro-batch in flight per stage keeps every stage busy within a step.
        self.num_micro_batches = par.pp
        num_blocks = _num_blocks(cfg, model_cfg, par)
        store = TCPStore(LOOPBACK, 0, par.world_size, True, wait_for_workers=False)
        spec = RankSpec(par, cfg, model_cfg, Path(model_dir), num_blocks, store.port)
        if self.device.type == "cpu":
            torch.set_num_threads(cpu_threads(spec))
        log.info("starting %d ranks (tp=%d, pp=%d)", par.world_size, par.tp, par.pp)
        self._pool = WorkerPool(spec, store)
        display = LoadDisplay(store, par.world_size, cfg.show_progress)
        try:
            comm = Comm(par, 0, self.device)
            self.shard = ShardRunner(spec, 0, comm, display)
            self._pool.wait_loaded(display)
            comm.connect(store)
        except BaseException:
            self._pool.close()
            raise
        finally:
            display.close()
        self._store = store  # the workers' rendezvous: alive as long as they are
        self._interrupted: str | None = None
        # Host tensors, which rank 0 broadcasts and every rank moves to its own device; the
        # decode attention is planned for rank 0's KV heads (all ranks hold as many).
        rank0 = rank_kv_layout(par, 0, model_cfg, cfg.block_size, self.dtype)
        cpu = torch.device("cpu")
        planner = attention_backend(self.device, rank0)
        self._batches = BatchBuilder(cfg.block_size, planner, cpu)
        self.kv_cache = ShardedKVCache(self.shard, self.layout, num_blocks, self._guard)
        self._pool.watch(comm.abort)

    # ---- health ---------------------------------------------------------------------
    @property
    def worker_pids(self) -> list[int]:
        """Process ids of ranks 1..N-1, in rank order."""
        return [p.pid for p in self._pool.procs if p.pid is not None]

    def check_health(self) -> None:
        """Raise :class:`EngineError` once a worker rank has died, or once a command failed
        half way (the ranks may then wait in different collectives: nothing can run)."""
        failure = self._pool.failure or self._interrupted
        if failure is not None:
            raise EngineError(f"parallel engine failed: {failure}")

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        self.check_health()
        try:
            yield
        except RuntimeError as exc:  # gloo/NCCL: a peer closed its socket or timed out
            raise self._pool.failed(exc) from exc
        except BaseException as exc:
            self._interrupted = f"rank 0 stopped in the middle of a command: {exc!r}"
            raise

    def close(self) -> None:
        """Stop every worker (the engine cannot step afterwards)."""
        if self._pool.failure is None and self._interrupted is None:
            with contextlib.suppress(RuntimeError):
                self.shard.comm.broadcast_object(("stop",))
        self._pool.close()

    # ---- steps ----------------------------------------------------------------------
    def _run(self, mbs: list[MicroBatch]) -> torch.Tensor:
        with self._guard():
            self.shard.comm.broadcast_object(("step", mbs))
            out = self.shard.step(mbs)
        return out[0] if len(out) == 1 else torch.cat(out)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Sequence]]:
        """Run a batch; returns float32 logits ``[N + P, vocab]`` as ``ModelRunner.execute``."""
        mbs: list[MicroBatch] = []
        samplers: list[Sequence] = []
        sizes: list[int] = []  # per micro-batch: its samplers' rows, then its prompt rows
        for entries in split_entries(batch.entries, self.num_micro_batches):
            step = self._batches.build(ScheduledBatch(entries=entries))
            rows = step.logits_indices
            mbs.append(
                MicroBatch(step.input_ids, step.positions, step.meta, rows, step.max_position)
            )
            samplers.extend(step.samplers)
            sizes += [len(step.samplers), len(rows) - len(step.samplers)]
        logits = self._run(mbs)
        if len(mbs) > 1 and logits.shape[0] > len(samplers):
            # As the single runner returns them: every sampler row first, then prompt rows.
            parts = logits.split(sizes)
            logits = torch.cat([*parts[0::2], *parts[1::2]])
        return logits, samplers

    @torch.inference_mode()
    def prompt_logits(self, seq: Sequence) -> torch.Tensor:
        """Logits ``[T, vocab]`` for every position of ``seq`` (blocks already allocated)."""
        step = self._batches.build(ScheduledBatch([(seq, seq.num_tokens)]))
        return self._run(
            [MicroBatch(step.input_ids, step.positions, step.meta, None, step.max_position)]
        )
