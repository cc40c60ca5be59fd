"""The paged KV cache tensors: one K and one V tensor per layer, preallocated.

Layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (token-major inside a
block, as flash-attention's paged layout), so one block of one layer is a contiguous page
that can be shipped to another engine as is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgeinfer.daemon.engine.errors import EngineError


@dataclass(frozen=True)
class KVLayout:
    """Everything two engines must agree on to exchange KV pages."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of one layer, K or V."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.block_size * self.num_kv_heads * self.head_dim * itemsize


def num_blocks_for_budget(layout: KVLayout, budget_bytes: int) -> int:
    """How many blocks a memory budget buys (K and V of every layer per block)."""
    per_block = 2 * layout.num_layers * layout.page_bytes
    return max(budget_bytes // per_block, 0)


class KVCache:
    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device) -> None:
        if num_blocks < 1:
            raise EngineError("the KV-cache budget does not fit a single block; raise it")
        self.layout = layout
        self.num_blocks = num_blocks
        # One extra block past the managed ones: padded rows of a captured CUDA graph write
        # their (ignored) K/V there instead of into a block some sequence owns.
        self.scratch_slot = num_blocks * layout.block_size
        shape = (num_blocks + 1, layout.block_size, layout.num_kv_heads, layout.head_dim)
        self.k = [
            torch.zeros(shape, dtype=layout.dtype, device=device) for _ in range(layout.num_layers)
        ]
        self.v = [
            torch.zeros(shape, dtype=layout.dtype, device=device) for _ in range(layout.num_layers)
        ]

    def read_blocks(
        self, block_ids: list[int], layers: range | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the given blocks per layer: ``[(k, v)]`` each ``[n, bs, Hkv, D]``."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.k[0].device)
        layers = layers if layers is not None else range(self.layout.num_layers)
        return [(self.k[i].index_select(0, idx), self.v[i].index_select(0, idx)) for i in layers]

    def write_blocks(
        self, block_ids: list[int], layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write pages ``k``/``v`` ``[n, bs, Hkv, D]`` of one layer into ``block_ids``."""
        expected = (len(block_ids), *self.k[layer].shape[1:])
        if tuple(k.shape) != expected or tuple(v.shape) != expected:
            raise EngineError(f"KV page shape {tuple(k.shape)} does not match {expected}")
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.k[layer].device)
        self.k[layer].index_copy_(0, idx, k.to(self.k[layer].device, self.layout.dtype))
        self.v[layer].index_copy_(0, idx, v.to(self.v[layer].device, self.layout.dtype))
