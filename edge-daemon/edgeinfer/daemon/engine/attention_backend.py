"""The attention every layer of a model calls, chosen once at load for its device and cache.

:func:`attention_backend` picks, from the device, the cache's dtype and width and whether the
compiled kernels built on this host, the object that (1) plans a step's decode attention on the
host, once per step (:meth:`AttentionBackend.plan_decode`), and (2) attends each layer's decode
tokens and prefill chunks. Which CPU kernel serves which batch or chunk size is still decided
per step by the routes that ``kernel_trials`` timed at load (see :mod:`cpu_attention`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from edgeinfer.daemon.engine.attention_metadata import AttentionMetadata, PrefillSegment
from edgeinfer.daemon.engine.cpu_attention import (
    decode_in_place,
    prefill_grouped,
    prefill_in_place,
)
from edgeinfer.daemon.engine.kv_cache import KVLayout
from edgeinfer.kernels.paged_attention import decode_attention, paged_prefill_attention_ref
from edgeinfer.kernels.paged_attention_cpu import (
    paged_decode_attention_cpu,
    paged_prefill_attention_cpu,
    plan_decode_cpu,
    prefill_attention_cpu,
)
from edgeinfer.kernels.paged_attention_native import paged_prefill_attention_native
from edgeinfer.kernels.paged_attention_numba import paged_decode_attention_numba


class AttentionBackend:
    """Paged attention in portable torch (and Triton where it runs): CUDA's backend."""

    def plan_decode(
        self, meta: AttentionMetadata, tables: list[list[int]], lens: list[int], block_size: int
    ) -> None:
        """Host-side work every layer's decode attention shares; once per step."""

    def decode(
        self,
        q: Tensor,  # [B, H, D], the step's decode tokens
        k_cache: Tensor,  # one layer's [num_blocks, block_size, Hkv, D]
        v_cache: Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: Tensor,  # [B, H, D], written
    ) -> None:
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        if tables is None or lens is None:
            raise RuntimeError("a decode batch without block tables")
        out.copy_(decode_attention(q, k_cache, v_cache, tables, lens, scale))

    def prefill(
        self,
        q: Tensor,  # [T, H, D], one sequence's chunk
        k: Tensor,  # [T, Hkv, D], the chunk's own keys (also cached by now)
        v: Tensor,
        seg: PrefillSegment,
        k_cache: Tensor,
        v_cache: Tensor,
        scale: float,
        out: Tensor,  # [T, H, D], written
    ) -> None:
        """Causal attention of a chunk over its cached prefix and itself."""
        if seg.start_pos:
            out.copy_(
                paged_prefill_attention_ref(
                    q, k_cache, v_cache, seg.block_table, seg.start_pos, scale
                )
            )
            return
        # Nothing cached before the chunk: attend to its own K/V without a gather.
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )
        out.copy_(o.transpose(0, 1))


class CpuAttention(AttentionBackend):
    """The CPU kernels of :mod:`cpu_attention`: in place where they take the cache, else
    torch's, on a plan made once per step."""

    def __init__(self, layout: KVLayout) -> None:
        self.dtype = layout.dtype
        self.kv_values = 2 * layout.num_kv_heads * layout.head_dim  # per cached token
        self.key_bytes = self.kv_values * layout.dtype.itemsize

    def plan_decode(
        self, meta: AttentionMetadata, tables: list[list[int]], lens: list[int], block_size: int
    ) -> None:
        if decode_in_place(self.dtype, self.kv_values, len(lens)):
            meta.decode_in_place = True
        else:
            meta.decode_plan = plan_decode_cpu(tables, lens, block_size, self.key_bytes)

    def decode(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: Tensor,
    ) -> None:
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        if tables is None or lens is None:
            raise RuntimeError("a decode batch without block tables")
        if meta.decode_in_place:
            prepared = meta.native_decode(q.shape[1], k_cache)
            if prepared is not None:
                prepared(q, k_cache, v_cache, scale, out)
            else:  # the compiled kernel did not build, or lost here: numba's
                paged_decode_attention_numba(q, k_cache, v_cache, tables, lens, scale, out)
        elif meta.decode_plan is not None:
            paged_decode_attention_cpu(
                q, k_cache, v_cache, tables, lens, scale, meta.decode_plan, out
            )
        else:  # planned by a runner of another device kind
            super().decode(q, k_cache, v_cache, meta, scale, out)

    def prefill(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        seg: PrefillSegment,
        k_cache: Tensor,
        v_cache: Tensor,
        scale: float,
        out: Tensor,
    ) -> None:
        if prefill_in_place(q, k_cache):
            paged_prefill_attention_native(
                q, k_cache, v_cache, seg.block_table, seg.start_pos, scale, out
            )
        elif seg.start_pos:
            grouped = prefill_grouped(q, k_cache)
            table, start = seg.block_table, seg.start_pos
            out.copy_(
                paged_prefill_attention_cpu(q, k_cache, v_cache, table, start, scale, grouped)
            )
        else:
            out.copy_(prefill_attention_cpu(q, k, v, scale))


def attention_backend(device: torch.device, layout: KVLayout) -> AttentionBackend:
    """The backend for a KV cache of ``layout`` on ``device`` (one per model or shard)."""
    return CpuAttention(layout) if device.type == "cpu" else AttentionBackend()
