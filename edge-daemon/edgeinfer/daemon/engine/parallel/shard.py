"""One rank's share of the engine: its model shard, its KV cache, and its part of each command.

The same class serves the driver (rank 0, inside the engine thread) and every worker, so all
ranks run literally the same code for a step, a KV read and a KV write.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from edgeinfer.daemon.engine.attention_backend import attention_backend
from edgeinfer.daemon.engine.checkpoint import CheckpointReader
from edgeinfer.daemon.engine.config import EngineConfig
from edgeinfer.daemon.engine.kv_cache import KVCache, KVLayout
from edgeinfer.daemon.engine.model_config import ModelConfig
from edgeinfer.daemon.engine.parallel.comm import Comm
from edgeinfer.daemon.engine.parallel.layout import ParallelLayout
from edgeinfer.daemon.engine.parallel.pp import MicroBatch, run_pipeline
from edgeinfer.daemon.engine.parallel.progress import StoreProgress
from edgeinfer.daemon.engine.parallel.tp import build_shard, load_shard

KV_TAG = 7  # KV pages on the control group (rank 0 <-> one rank at a time)


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs to build its shard; pickled to each spawned worker."""

    layout: ParallelLayout
    engine: EngineConfig
    model: ModelConfig
    model_dir: Path
    num_blocks: int
    store_port: int


def rank_device(cfg: EngineConfig, rank: int) -> torch.device:
    """One GPU per rank on CUDA (``cuda:rank``); every rank on the CPU otherwise."""
    return (
        torch.device("cuda", rank)
        if torch.device(cfg.device).type == "cuda"
        else torch.device("cpu")
    )


def rank_kv_layout(
    par: ParallelLayout, rank: int, cfg: ModelConfig, block_size: int, dtype: torch.dtype
) -> KVLayout:
    """The KV cache of one rank: its stage's layers, its KV heads."""
    stage, t = par.coords(rank)
    return KVLayout(
        num_layers=len(par.stage_layers(stage, cfg.num_layers)),
        block_size=block_size,
        num_kv_heads=len(par.kv_heads(t, cfg)),
        head_dim=cfg.head_dim,
        dtype=dtype,
    )


class ShardRunner:
    def __init__(self, spec: RankSpec, rank: int, comm: Comm, progress: StoreProgress) -> None:
        cfg = spec.model
        self.spec, self.rank, self.comm = spec, rank, comm
        self.device = rank_device(spec.engine, rank)
        self.dtype = spec.engine.resolve_dtype(cfg)
        stage, self.tp_rank = spec.layout.coords(rank)
        self.layers = spec.layout.stage_layers(stage, cfg.num_layers)
        self.model = build_shard(cfg, spec.layout, rank, comm, self.device, self.dtype)
        with CheckpointReader(spec.model_dir) as reader:
            load_shard(self.model, reader, cfg, spec.layout, rank, self.dtype, progress)
        kv_layout = rank_kv_layout(spec.layout, rank, cfg, spec.engine.block_size, self.dtype)
        self.kv_cache = KVCache(kv_layout, spec.num_blocks, self.device)
        self.model.use_attention(attention_backend(self.device, kv_layout))

    @torch.inference_mode()
    def step(self, mbs: list[MicroBatch]) -> list[torch.Tensor]:
        """This rank's part of one step; rank 0 gets float32 logits per micro-batch."""
        mbs = [mb.to(self.device) for mb in mbs]
        hidden = (self.spec.model.hidden_size, self.dtype)
        vocab = self.spec.model.vocab_size
        return run_pipeline(self.model, self.layers, self.kv_cache, self.comm, mbs, hidden, vocab)

    # ---- KV pages, always exchanged in host memory over the gloo control group ----------
    def owned(self, layers: range) -> range:
        """The part of ``layers`` (global indices) this rank's stage holds, as local indices."""
        lo, hi = max(layers.start, self.layers.start), min(layers.stop, self.layers.stop)
        return range(lo - self.layers.start, max(hi, lo) - self.layers.start)

    def pages(self, block_ids: list[int], own: range) -> torch.Tensor:
        """Host copies ``[len(own), 2, n, bs, Hkv_rank, D]`` of local layers ``own``."""
        kv = self.kv_cache.read_blocks(block_ids, own)
        return torch.stack([torch.stack(pair) for pair in kv]).cpu()

    def send_kv(self, block_ids: list[int], layers: range) -> None:
        """Send rank 0 this rank's part of ``layers``; replicas of another rank's KV heads
        and stages without any of those layers send nothing."""
        own = self.owned(layers)
        if own and self.spec.layout.kv_primary(self.tp_rank, self.spec.model):
            self.comm.ctrl_send(self.pages(block_ids, own), 0, KV_TAG)

    def write_kv(self, block_ids: list[int], layer: int, kv: torch.Tensor) -> None:
        """Write this rank's head slice ``kv`` ``[2, n, bs, Hkv_rank, D]`` of global ``layer``."""
        local = layer - self.layers.start
        self.kv_cache.write_blocks(block_ids, local, kv[0], kv[1])

    def recv_kv(self, block_ids: list[int], layer: int) -> None:
        if layer not in self.layers:
            return
        layout = self.kv_cache.layout
        shape = (2, len(block_ids), layout.block_size, layout.num_kv_heads, layout.head_dim)
        kv = self.comm.ctrl_recv(torch.empty(shape, dtype=layout.dtype), 0, KV_TAG)
        self.write_kv(block_ids, layer, kv)
