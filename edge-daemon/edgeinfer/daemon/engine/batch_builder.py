"""A scheduled batch flattened into one step's model inputs, for every kind of runner.

Decode tokens come first (shortest context first: the CPU decode kernel attends runs of similar
lengths), then each prefill chunk. The single-process runner builds on its device; the
tensor/pipeline-parallel executor builds host tensors per micro-batch, which rank 0 broadcasts
and every rank moves to its own device.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from edgeinfer.daemon.engine.attention_backend import AttentionBackend
from edgeinfer.daemon.engine.attention_metadata import AttentionMetadata, PrefillSegment
from edgeinfer.daemon.engine.scheduler import ScheduledBatch
from edgeinfer.daemon.engine.sequence import Sequence
from edgeinfer.kernels.paged_attention_cpu import int_tensor


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    # Rows of T whose logits are needed: the samplers' (in ``samplers`` order), then the
    # prompt positions whose logprobs were asked for (in ``batch.entries`` order).
    logits_indices: torch.Tensor
    meta: AttentionMetadata
    samplers: list[Sequence]  # sequences that sample a token this step
    max_position: int  # max(positions), known on the host


class BatchBuilder:
    def __init__(self, block_size: int, attention: AttentionBackend, device: torch.device) -> None:
        self.block_size = block_size
        self.attention = attention  # plans the step's decode attention (once, for every layer)
        self.device = device

    def build(self, batch: ScheduledBatch) -> StepInputs:
        bs = self.block_size
        decodes = sorted(
            ((s, n) for s, n in batch.entries if n == 1), key=lambda e: e[0].num_computed_tokens
        )
        prefills = [(s, n) for s, n in batch.entries if n != 1]
        # array, not list: int_tensor wraps them without torch.tensor's per-element checks.
        ids, pos, slots, logit_rows = array("q"), array("q"), array("q"), array("q")
        samplers: list[Sequence] = []
        first_row: dict[int, int] = {}  # id(seq) -> its first token's row this step

        for seq, _ in decodes:  # one token each: no ranges to build
            p = seq.num_computed_tokens
            first_row[id(seq)] = len(ids)
            ids.append(seq.token_ids[p])
            pos.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
            if p + 1 == seq.num_tokens:
                logit_rows.append(len(ids) - 1)
                samplers.append(seq)
        segments: list[PrefillSegment] = []
        for seq, n in prefills:
            start = seq.num_computed_tokens
            row = len(ids)
            first_row[id(seq)] = row
            ids.extend(seq.token_ids[start : start + n])
            table = seq.block_table
            pos.extend(range(start, start + n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if start + n == seq.num_tokens:
                logit_rows.append(len(ids) - 1)
                samplers.append(seq)
            num_blocks = (start + n + bs - 1) // bs
            blocks = int_tensor(array("i", table[:num_blocks]), torch.int32)
            segments.append(
                PrefillSegment(
                    start=row, length=n, start_pos=start, block_table=blocks.to(self.device)
                )
            )
        for seq, n in batch.entries:
            span = seq.prompt_logprob_positions(n)
            row = first_row[id(seq)] - seq.num_computed_tokens
            logit_rows.extend(range(row + span.start, row + span.stop))
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=int_tensor(slots, torch.long).to(dev),
            num_decode_tokens=len(decodes),
            prefills=segments,
        )
        if decodes:
            seq_tables = [s.block_table for s, _ in decodes]
            width = max(len(t) for t in seq_tables)
            tables = array("i")
            for t in seq_tables:
                tables.extend(t)
                tables.extend([0] * (width - len(t)))
            lens = [s.num_computed_tokens + 1 for s, _ in decodes]
            meta.decode_block_tables = int_tensor(tables, torch.int32).view(-1, width).to(dev)
            meta.decode_context_lens = int_tensor(array("i", lens), torch.int32).to(dev)
            self.attention.plan_decode(meta, seq_tables, lens, bs)
        return StepInputs(
            input_ids=int_tensor(ids, torch.long).to(dev),
            positions=int_tensor(pos, torch.long).to(dev),
            logits_indices=int_tensor(logit_rows, torch.long).to(dev),
            meta=meta,
            samplers=samplers,
            max_position=max(pos, default=0),
        )
