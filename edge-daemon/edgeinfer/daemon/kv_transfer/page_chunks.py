"""KV pages as ``kv`` messages: cutting exported pages into chunks, checking arriving ones.

Both directions use it: the prefill side pushes the blocks it computed, the decode side answers
a ``kv_pull`` with blocks it holds. A chunk is a run of blocks times a group of layers of at
most about ``chunk_bytes``, K and V of each layer as two payload frames ``[n, block_size, Hkv,
D]``; slices of the exported pages, so no copy is made.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from edgeinfer.daemon.engine.llm_engine import LLMEngine
from edgeinfer.daemon.kv_transfer.errors import KVTransferError
from edgeinfer.daemon.kv_transfer.messages import KVChunk, WireLayout
from edgeinfer.daemon.kv_transfer.tensor_codec import (
    page_bytes,
    page_shape,
    payload_tensor,
    tensor_payload,
)

Pages = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (K, V), each [n, bs, Hkv, D]


class ChunkRejected(KVTransferError):
    """An arriving chunk does not fit what the receiver still expects."""


def page_chunks(
    rid: str, first_seq: int, start: int, pages: Pages, layout: WireLayout, chunk_bytes: int
) -> Iterator[KVChunk]:
    """Chunks of ``pages`` (logical blocks ``start``...), numbered from ``first_seq``."""
    n = pages[0][0].shape[0] if pages else 0
    pair_bytes = 2 * page_bytes(layout)  # K + V of one block of one layer
    chunk_bytes = max(chunk_bytes, 1)
    blocks_per = max(1, min(n, chunk_bytes // pair_bytes))
    seq = first_seq
    for b0 in range(0, n, blocks_per):
        b1 = min(n, b0 + blocks_per)
        layers_per = max(1, chunk_bytes // (pair_bytes * (b1 - b0)))
        for l0 in range(0, layout.num_layers, layers_per):
            l1 = min(layout.num_layers, l0 + layers_per)
            # Slices along dim 0 of contiguous pages are contiguous views: no copy.
            parts = [t[b0:b1] for layer in range(l0, l1) for t in pages[layer]]
            yield KVChunk(
                rid,
                seq,
                (l0, l1),
                tuple(range(start + b0, start + b1)),
                layout.dtype,
                tuple(tuple(p.shape) for p in parts),
                tuple(tensor_payload(p) for p in parts),
            )
            seq += 1


def check_chunk(msg: KVChunk, layout: WireLayout, missing: list[set[int]]) -> int:
    """Validate a chunk against the blocks each layer still owes (``missing``, updated);
    return its first block. Raises :class:`ChunkRejected`."""
    start, stop = msg.layers
    blocks = msg.blocks
    if msg.dtype != layout.dtype or stop > layout.num_layers or not blocks:
        raise ChunkRejected(f"dtype {msg.dtype}, layers {msg.layers}")
    if list(blocks) != list(range(blocks[0], blocks[0] + len(blocks))):
        raise ChunkRejected("blocks are not one ascending run")
    want = page_shape(layout, len(blocks))
    # Two payloads (K then V) per layer, each [n, block_size, Hkv, D].
    if len(msg.shapes) != 2 * (stop - start) or any(s != want for s in msg.shapes):
        raise ChunkRejected(f"shapes {msg.shapes[:2]} for {want}")
    needed = set(blocks)
    for layer in range(start, stop):
        if not needed <= missing[layer]:
            raise ChunkRejected(f"layer {layer} blocks not owed (or sent twice)")
    for layer in range(start, stop):
        missing[layer] -= needed
    return blocks[0]


def chunk_importer(rid: str, msg: KVChunk, start_block: int) -> Callable[[LLMEngine], None]:
    """An engine call writing ``msg``'s pages (aliasing its frames) into ``rid``'s blocks."""
    tensors = [payload_tensor(buf, msg.dtype, shape) for buf, shape in zip(msg.frames, msg.shapes)]
    first_layer = msg.layers[0]

    def run(engine: LLMEngine) -> None:
        for i in range(0, len(tensors), 2):
            engine.import_kv(rid, start_block, first_layer + i // 2, tensors[i], tensors[i + 1])

    return run
