"""The engine's KV-cache view of a cache spread over ranks, in the single-process layout.

:class:`LLMEngine` reads and writes pages as ``[n, block_size, num_kv_heads, head_dim]`` per
layer, all heads and all layers, whatever the layout (that is also the wire format between a
prefill and a decode daemon). Here a read gathers each layer from the stage that holds it and
concatenates the heads of that stage's TP ranks (one copy of replicated heads); a write splits
the heads again and sends every rank its slice. So pages cross layouts (TP=2 prefill, TP=1
decode, and the reverse) with no extra step.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from edgeinfer.daemon.engine.errors import EngineError
from edgeinfer.daemon.engine.kv_cache import KVLayout
from edgeinfer.daemon.engine.parallel.shard import KV_TAG, ShardRunner


class ShardedKVCache:
    def __init__(
        self,
        shard: ShardRunner,
        layout: KVLayout,
        num_blocks: int,
        guard: Callable[[], AbstractContextManager[None]],
    ) -> None:
        self.shard = shard
        self.layout = layout  # the full (single-process) layout
        self.num_blocks = num_blocks
        self._guard = guard  # turns a failed collective into the engine's error

    def read_blocks(
        self, block_ids: list[int], layers: range | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Host copies of the given blocks per layer: ``[(k, v)]`` each ``[n, bs, Hkv, D]``."""
        shard, spec = self.shard, self.shard.spec
        par, cfg = spec.layout, spec.model
        layers = layers if layers is not None else range(self.layout.num_layers)
        n, lay = len(block_ids), self.layout
        heads: dict[int, list[torch.Tensor]] = {i: [] for i in layers}  # [2, n, bs, h, D] each
        with self._guard():
            shard.comm.broadcast_object(("read_kv", block_ids, layers))
            for stage in range(par.pp):
                stage_layers = par.stage_layers(stage, cfg.num_layers)
                wanted = [i for i in layers if i in stage_layers]
                for t in range(par.tp) if wanted else ():
                    if not par.kv_primary(t, cfg):
                        continue
                    rank = par.rank_of(stage, t)
                    if rank == 0:
                        pages = shard.pages(block_ids, shard.owned(layers))
                    else:
                        shape = (len(wanted), 2, n, lay.block_size, len(par.kv_heads(t, cfg)))
                        buf = torch.empty(*shape, lay.head_dim, dtype=lay.dtype)
                        pages = shard.comm.ctrl_recv(buf, rank, KV_TAG)
                    for j, i in enumerate(wanted):
                        heads[i].append(pages[j])
        out = []
        for i in layers:
            kv = torch.cat(heads[i], dim=3)
            out.append((kv[0], kv[1]))
        return out

    def write_blocks(
        self, block_ids: list[int], layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write pages ``k``/``v`` ``[n, bs, Hkv, D]`` (all heads) of one layer."""
        lay = self.layout
        expected = (len(block_ids), lay.block_size, lay.num_kv_heads, lay.head_dim)
        if tuple(k.shape) != expected or tuple(v.shape) != expected:
            raise EngineError(f"KV page shape {tuple(k.shape)} does not match {expected}")
        shard, spec = self.shard, self.shard.spec
        par, cfg = spec.layout, spec.model
        kv = torch.stack([k, v]).to("cpu", lay.dtype)  # [2, n, bs, Hkv, D]
        stage = par.stage_of(layer, cfg.num_layers)
        with self._guard():
            shard.comm.broadcast_object(("write_kv", block_ids, layer))
            for t in range(par.tp):
                h = par.kv_heads(t, cfg)
                part = kv[:, :, :, h.start : h.stop]
                rank = par.rank_of(stage, t)
                if rank == 0:
                    shard.write_kv(block_ids, layer, part.to(shard.device))
                else:
                    shard.comm.ctrl_send(part, rank, KV_TAG)
