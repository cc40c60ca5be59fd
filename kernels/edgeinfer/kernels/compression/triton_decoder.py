"""Triton GPU decoder: one lane per chunk, one symbol per lane per step, output written in place.

The word stream is decoded by ``_decode_kernel``; a palette-mode tensor then takes one more,
trivially parallel pass (``_palette_kernel``, one thread per element) that looks each element's
word up in its block's palette, whose start comes from a prefix sum of the block sizes.

Each program of ``_decode_kernel`` decodes ``BLOCK`` chunks side by side. A lane peeks ``max_len`` bits at its bit
position (three byte loads cover 12 + 7 bits), looks the window up in the single-symbol table
(``symbol | length << 16``; 2**max_len <= 4096 entries, so it stays in L1), joins the symbol with
the raw field (a byte, or a ``RAW_BITS``-bit field of an extended stream: one two-byte read) and
stores the final 16-bit word. Chunk starts come from ``CompressedTensor.chunk_starts`` (a prefix
sum on the device for extended streams). Runs on CUDA, and on the CPU under
``TRITON_INTERPRET=1`` (used by the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edgeinfer.kernels.compression.format import PAD_BYTES, CompressedTensor
from edgeinfer.kernels.compression.huffman import LENGTH_SHIFT, decode_table
from edgeinfer.kernels.compression.palette import COUNT_BITS, n_blocks

BLOCK = 128
PALETTE_BLOCK = 1024


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
    RAW_BITS: tl.constexpr,
    LENGTH_SHIFT: tl.constexpr,
):
    lane = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = lane < n_chunks
    pos = tl.load(offsets_ptr + lane, mask=live, other=0) * 8
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
        if RAW_BITS == 8:
            raw = tl.load(raw_ptr + i, mask=ok, other=0).to(tl.int32)
        else:
            # Packed fields are followed by padding, so the second byte is always in bounds.
            rbit = i * RAW_BITS
            r0 = tl.load(raw_ptr + (rbit >> 3), mask=ok, other=0).to(tl.int32)
            r1 = tl.load(raw_ptr + (rbit >> 3) + 1, mask=ok, other=0).to(tl.int32)
            raw = ((r0 | (r1 << 8)) >> (rbit & 7).to(tl.int32)) & ((1 << RAW_BITS) - 1)
        word = ((entry & 0xFFFF) << RAW_BITS) | raw
        if ROTATE:
            # bf16: undo the encoder's rotate-left (eeeeeeee mmmmmmms -> s eeeeeeee mmmmmmm).
            word = (word >> 1) | ((word & 1) << 15)
        tl.store(out_ptr + i, word.to(tl.int16), mask=ok)
        pos += (entry >> LENGTH_SHIFT).to(tl.int64)


@triton.jit
def _palette_kernel(
    palette_ptr,
    starts_ptr,
    index_ptr,
    out_ptr,
    n,
    last,
    block,
    width,
    field_mask,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    start = tl.load(starts_ptr + i // block, mask=ok, other=0)
    # The element's index field: one two-byte read (the fields are followed by FIELD_PAD bytes).
    bit = i * width
    lo = tl.load(index_ptr + (bit >> 3), mask=ok, other=0).to(tl.int32)
    hi = tl.load(index_ptr + (bit >> 3) + 1, mask=ok, other=0).to(tl.int32)
    field = ((lo | (hi << 8)) >> (bit & 7).to(tl.int32)) & field_mask
    # Clamp: a position past the palette (crafted input only) must stay in bounds.
    where = tl.minimum(start + field, last)
    word = tl.load(palette_ptr + where, mask=ok, other=0)
    tl.store(out_ptr + i, word, mask=ok)


def _decode_stream(stream: CompressedTensor) -> torch.Tensor:
    """The flat int16 words of a word stream, on its device."""
    device = stream.bits.device
    table, max_len = decode_table(*stream.code_lengths())
    table_dev = torch.from_numpy(table).to(device)
    m = stream.stream_words
    out = torch.empty(m, dtype=torch.int16, device=device)
    n_chunks = stream.offsets.numel()
    if n_chunks:
        _decode_kernel[(triton.cdiv(n_chunks, BLOCK),)](
            stream.bits,
            stream.chunk_starts(),
            stream.raw,
            table_dev,
            out,
            m,
            n_chunks,
            stream.bits.numel() - PAD_BYTES,
            (1 << max_len) - 1,
            stream.chunk,
            BLOCK=BLOCK,
            ROTATE=stream.dtype == "bfloat16",
            RAW_BITS=stream.raw_bits,
            LENGTH_SHIFT=LENGTH_SHIFT,
        )
    return out


def _block_starts(counts: torch.Tensor, blocks: int) -> torch.Tensor:
    """Where each block's palette starts (int64): the prefix sum of the stored sizes - 1."""
    bit = torch.arange(blocks, device=counts.device) * COUNT_BITS
    packed = counts.to(torch.int64)
    two = packed[bit >> 3] | (packed[(bit >> 3) + 1] << 8)
    sizes = ((two >> (bit & 7)) & ((1 << COUNT_BITS) - 1)) + 1
    return torch.cumsum(sizes, 0) - sizes


def decode_triton(tensor: CompressedTensor) -> torch.Tensor:
    """Decode on the device holding ``tensor``'s parts; returns a tensor there, bit for bit."""
    words = _decode_stream(tensor.stream())
    fields = tensor.palette
    if fields is not None and tensor.numel:
        out = torch.empty(tensor.numel, dtype=torch.int16, device=words.device)
        _palette_kernel[(triton.cdiv(tensor.numel, PALETTE_BLOCK),)](
            words,
            _block_starts(fields.counts, n_blocks(tensor.numel, fields.block)),
            fields.index,
            out,
            tensor.numel,
            words.numel() - 1,
            fields.block,
            fields.width,
            (1 << fields.width) - 1,
            BLOCK=PALETTE_BLOCK,
        )
        words = out
    return words.view(tensor.torch_dtype).reshape(tensor.shape)
