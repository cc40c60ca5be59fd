"""Pipeline parallelism: contiguous layer stages and micro-batches in flight across them.

A step's sequences are split into micro-batches. Every rank walks them in order: receive the
hidden states from the previous stage (unless first), run its layers, start sending to the
next stage (unless last) and go on with the next micro-batch at once, so stage ``s`` works on
micro-batch ``k`` while stage ``s + 1`` works on ``k - 1``. Each TP rank of a stage talks to
the TP rank of the same index in the neighbouring stages (the hidden states are replicated
within a stage after every all-reduce). The last stage's TP rank 0 sends logits to rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from edgeinfer.daemon.engine.attention_metadata import AttentionMetadata
from edgeinfer.daemon.engine.kv_cache import KVCache
from edgeinfer.daemon.engine.model import CausalLM
from edgeinfer.daemon.engine.parallel.comm import Comm
from edgeinfer.daemon.engine.rope import Rotation
from edgeinfer.daemon.engine.sequence import Sequence

_LOGITS_TAG = 1 << 20  # hidden states use the micro-batch index as their tag


@dataclass
class MicroBatch:
    """One micro-batch's flat model inputs as host tensors (pickled to the other ranks)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor | None  # [N] rows whose logits are wanted; None: all T
    max_position: int

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_logits(self) -> int:
        return self.num_tokens if self.logits_indices is None else self.logits_indices.numel()

    def to(self, device: torch.device) -> MicroBatch:
        def move(x: Any) -> Any:
            return x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x

        m = self.meta
        meta = AttentionMetadata(
            slot_mapping=move(m.slot_mapping),
            num_decode_tokens=m.num_decode_tokens,
            decode_block_tables=move(m.decode_block_tables),
            decode_context_lens=move(m.decode_context_lens),
            prefills=[replace(p, block_table=move(p.block_table)) for p in m.prefills],
            decode_plan=m.decode_plan if device.type == "cpu" else None,
            decode_in_place=m.decode_in_place and device.type == "cpu",
        )
        ids, pos, rows = move(self.input_ids), move(self.positions), move(self.logits_indices)
        return MicroBatch(ids, pos, meta, rows, self.max_position)


def split_entries(
    entries: list[tuple[Sequence, int]], parts: int
) -> list[list[tuple[Sequence, int]]]:
    """Up to ``parts`` contiguous, non-empty groups of about equal token counts."""
    parts = max(min(parts, len(entries)), 1)
    total = sum(n for _, n in entries)
    groups: list[list[tuple[Sequence, int]]] = []
    current: list[tuple[Sequence, int]] = []
    acc = 0
    for i, (seq, n) in enumerate(entries):
        current.append((seq, n))
        acc += n
        left, groups_left = len(entries) - i - 1, parts - len(groups) - 1
        full = acc * parts >= total * (len(groups) + 1)
        if groups_left > 0 and left >= groups_left and (full or left == groups_left):
            groups.append(current)
            current = []
    groups.append(current)
    return groups


def stage_forward(
    model: CausalLM,
    layers: range,
    kv: KVCache,
    mb: MicroBatch,
    x: torch.Tensor | None,
) -> torch.Tensor:
    """The stage's part of ``CausalLM.forward``: hidden ``[T, hidden]`` in (None on the first
    stage, which embeds the ids), hidden out, or float32 logits ``[N, vocab]`` on the last."""
    if x is None:
        x = model.model.embed_tokens(mb.input_ids)
    cos, sin = model.rotary_emb(mb.positions, mb.max_position)
    rot = Rotation.build(cos, sin, x.dtype)
    for j, i in enumerate(layers):  # j: the layer's index in this rank's KV cache
        x = model.model.layers[i](x, rot, mb.meta, kv.k[j], kv.v[j])
    if model.lm_head is None:
        return x
    if mb.logits_indices is not None:
        x = x.index_select(0, mb.logits_indices)
    return model.lm_head(model.model.norm(x)).float()


def run_pipeline(
    model: CausalLM,
    layers: range,
    kv: KVCache,
    comm: Comm,
    mbs: list[MicroBatch],
    hidden: tuple[int, torch.dtype],
    vocab_size: int,
) -> list[torch.Tensor]:
    """Run this rank's stage over every micro-batch; rank 0 gets each one's logits back."""
    layout, stage, t = comm.layout, comm.stage, comm.tp_rank
    last = layout.pp - 1
    device = kv.k[0].device
    sends: list[tuple[Any, torch.Tensor]] = []  # in-flight sends and the buffers they read
    out: list[torch.Tensor] = []
    for k, mb in enumerate(mbs):
        x = None
        if stage > 0:
            x = torch.empty(mb.num_tokens, hidden[0], dtype=hidden[1], device=device)
            comm.recv(x, layout.rank_of(stage - 1, t), k)
        y = stage_forward(model, layers, kv, mb, x)
        if stage < last:
            sends.append((comm.isend(y, layout.rank_of(stage + 1, t), k), y))
        elif comm.rank == 0:
            out.append(y)
        elif t == 0 and y.numel():
            y = y.contiguous()
            sends.append((comm.isend(y, 0, _LOGITS_TAG + k), y))
    if comm.rank == 0 and last > 0:
        src = layout.rank_of(last, 0)
        for k, mb in enumerate(mbs):
            logits = torch.empty(mb.num_logits, vocab_size, device=device)
            out.append(comm.recv(logits, src, _LOGITS_TAG + k) if logits.numel() else logits)
    for work, _ in sends:
        work.wait()
    return out
