"""What one forward step needs to know about the paged KV layout of its tokens.

The step's new tokens are flattened into one ``[T]`` batch: first one token per decoding
sequence (batched through paged decode attention; ordered by context length, which lets the
CPU kernel attend contiguous groups of similar lengths), then each prefill chunk (attended one
sequence at a time, causally over that sequence's cached prefix plus the chunk).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from edgeinfer.daemon.engine.cpu_attention import prepare_native_decode
from edgeinfer.kernels.paged_attention_cpu import DecodePlan
from edgeinfer.kernels.paged_attention_native import PreparedDecode


@dataclass
class PrefillSegment:
    start: int  # first index of the chunk in the flat token batch
    length: int
    start_pos: int  # position of the chunk's first token in its sequence
    block_table: torch.Tensor  # [num_blocks] int32, covers start_pos + length tokens


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) per token
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None  # [B_dec, max_blocks] int32
    decode_context_lens: torch.Tensor | None = None  # [B_dec] int32, including the new token
    # CPU only: the decode grouping every layer shares (planned once per step, on the host).
    decode_plan: DecodePlan | None = None
    # CPU float32/bf16: a kernel reads K/V in their pages, no plan needed (see cpu_attention.py).
    decode_in_place: bool = False
    prefills: list[PrefillSegment] = field(default_factory=list)
    _native_decode: PreparedDecode | None = field(default=None, init=False, repr=False)
    _native_checked: bool = field(default=False, init=False, repr=False)

    def native_decode(self, heads: int, k_cache: torch.Tensor) -> PreparedDecode | None:
        """In place decode attention compiled for these caches, its tables checked once for
        every layer of the step (the first layer prepares it); None where the compiled kernel
        does not take them."""
        if not self._native_checked:
            tables, lens = self.decode_block_tables, self.decode_context_lens
            if self.decode_in_place and tables is not None and lens is not None:
                self._native_decode = prepare_native_decode(tables, lens, k_cache, heads)
            self._native_checked = True
        return self._native_decode
