"""CUDA graphs for pure-decode steps, one per batch-size bucket (as nano-vllm and Infire do).

A decode step of a small model is dominated by kernel-launch overhead; replaying a captured
graph removes it. Each bucket's graph reads fixed input buffers: the runner copies the real
batch in, pads the remaining rows (context length 0, K/V written to a scratch slot, outputs
ignored) and replays the smallest bucket that fits. All buckets share one memory pool.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from edgeinfer.daemon.engine.attention_metadata import AttentionMetadata

if TYPE_CHECKING:
    from edgeinfer.daemon.engine.batch_builder import StepInputs
    from edgeinfer.daemon.engine.model_runner import ModelRunner


def _buckets(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8]
    sizes += list(range(16, max_batch + 1, 16))
    return sorted({b for b in sizes if b <= max_batch} | {max_batch})


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, max_batch: int, max_model_len: int) -> None:
        self.runner = runner
        self.buckets = _buckets(max_batch)
        self.max_position = max_model_len - 1
        bs = runner.block_size
        self.max_blocks = (max_model_len + bs - 1) // bs
        dev = runner.device
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.zeros(n, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=dev)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.logits: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        runner.model.rotary_emb.ensure_capacity(max_model_len)
        self._capture()

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            num_decode_tokens=bs,
            decode_block_tables=self.block_tables[:bs],
            decode_context_lens=self.context_lens[:bs],
        )

    def _forward(self, bs: int) -> torch.Tensor:
        r = self.runner
        return r.model(
            self.input_ids[:bs],
            self.positions[:bs],
            self._meta(bs),
            r.kv_cache,
            None,
            self.max_position,
        )

    @torch.inference_mode()
    def _capture(self) -> None:
        self.slot_mapping.fill_(self.runner.kv_cache.scratch_slot)
        pool = None
        for bs in reversed(self.buckets):  # largest first: later graphs reuse its pool
            self._forward(bs)  # warm-up: Triton autotuning and lazy allocations
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[bs] = self._forward(bs)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def can_run(self, batch_size: int) -> bool:
        return 0 < batch_size <= self.buckets[-1]

    def run(self, step: StepInputs) -> torch.Tensor:
        """Replay the bucket fitting this decode batch; returns logits ``[B, vocab]``."""
        meta = step.meta
        n = meta.num_decode_tokens
        bs = next(b for b in self.buckets if b >= n)
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        if tables is None or lens is None:
            raise RuntimeError("a decode batch without block tables")
        self.input_ids[:n].copy_(step.input_ids)
        self.positions[:n].copy_(step.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:bs].fill_(self.runner.kv_cache.scratch_slot)
        self.block_tables[:n, : tables.shape[1]].copy_(tables)
        self.context_lens[:n].copy_(lens)
        self.context_lens[n:bs].zero_()
        self.graphs[bs].replay()
        return self.logits[bs][:n]
