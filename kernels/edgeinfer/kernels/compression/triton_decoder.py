"""Triton GPU decoder: one lane per chunk, one symbol per lane per step, output written in place.

Each program decodes ``BLOCK`` chunks side by side. A lane peeks ``max_len`` bits at its bit
position (three byte loads cover 12 + 7 bits), looks the window up in the single-symbol table
(``symbol | length << 8``; 2**max_len <= 4096 entries, so it stays in L1), joins the symbol with
the raw byte and stores the final 16-bit word. Runs on CUDA, and on the CPU under
``TRITON_INTERPRET=1`` (used by the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edgeinfer.kernels.compression.format import PAD_BYTES, CompressedTensor
from edgeinfer.kernels.compression.huffman import decode_table

BLOCK = 128


@triton.jit
def _decode_kernel(
    bits_ptr,
    offsets_ptr,
    raw_ptr,
    table_ptr,
    out_ptr,
    n,
    n_chunks,
    last_byte,
    window_mask,
    chunk,
    BLOCK: tl.constexpr,
    ROTATE: tl.constexpr,
):
    lane = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = lane < n_chunks
    pos = tl.load(offsets_ptr + lane, mask=live, other=0).to(tl.int64) * 8
    first = lane.to(tl.int64) * chunk
    for step in range(chunk):
        i = first + step
        ok = live & (i < n)
        # Clamp so that even crafted input cannot read past the stream (padding covers 2 bytes).
        byte = tl.minimum(pos >> 3, last_byte)
        b0 = tl.load(bits_ptr + byte, mask=ok, other=0).to(tl.int32)
        b1 = tl.load(bits_ptr + byte + 1, mask=ok, other=0).to(tl.int32)
        b2 = tl.load(bits_ptr + byte + 2, mask=ok, other=0).to(tl.int32)
        window = ((b0 | (b1 << 8) | (b2 << 16)) >> (pos & 7).to(tl.int32)) & window_mask
        entry = tl.load(table_ptr + window, mask=ok, other=0)
        raw = tl.load(raw_ptr + i, mask=ok, other=0).to(tl.int32)
        word = ((entry & 0xFF) << 8) | raw
        if ROTATE:
            # bf16: undo the encoder's rotate-left (eeeeeeee mmmmmmms -> s eeeeeeee mmmmmmm).
            word = (word >> 1) | ((word & 1) << 15)
        tl.store(out_ptr + i, word.to(tl.int16), mask=ok)
        pos += (entry >> 8).to(tl.int64)


def decode_triton(tensor: CompressedTensor) -> torch.Tensor:
    """Decode on the device holding ``tensor``'s parts; returns a tensor there, bit for bit."""
    device = tensor.bits.device
    table, max_len = decode_table(tensor.code.cpu().numpy())
    table_dev = torch.from_numpy(table.astype("int32")).to(device)
    out = torch.empty(tensor.numel, dtype=torch.int16, device=device)
    n_chunks = tensor.offsets.numel()
    if n_chunks:
        _decode_kernel[(triton.cdiv(n_chunks, BLOCK),)](
            tensor.bits,
            tensor.offsets,
            tensor.raw,
            table_dev,
            out,
            tensor.numel,
            n_chunks,
            tensor.bits.numel() - PAD_BYTES,
            (1 << max_len) - 1,
            tensor.chunk,
            BLOCK=BLOCK,
            ROTATE=tensor.dtype == "bfloat16",
        )
    return out.view(tensor.torch_dtype).reshape(tensor.shape)
