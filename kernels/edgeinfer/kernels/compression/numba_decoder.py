"""Compiled CPU decoder (numba): table-driven Huffman decoding of four chunks at a time.

Decoding one chunk is a chain of dependent steps (the next codeword starts where this one ends),
so a single chunk leaves most of a core idle; the loop therefore advances four chunks side by
side, whose chains overlap. Per group of four codewords a lane reads 56 bits at its bit position
with seven byte loads (no bit buffer to refill, hence no unpredictable refill branch); shifted
by the position's bit offset, at least 49 bits remain, enough for four codewords of at most
``MAX_CODE_LEN`` (12) bits. Each codeword costs one lookup in the single-symbol table
(``symbol | length << 8``), and is joined with its raw byte and written as the final 16-bit word
in the same pass. Palette-mode tensors then look their words up with a loop over elements.

The functions are compiled on first use and cached on disk (``cache=True``), and release the GIL
(``nogil=True``) so that callers may decode several tensors on several threads.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from edgeinfer.kernels.compression.format import CompressedTensor
from edgeinfer.kernels.compression.huffman import MAX_CODE_LEN, decode_table
from edgeinfer.kernels.compression.palette import COUNT_BITS

# Codewords decoded per 56-bit read: 4 * 12 <= 56 - 7.
_PER_READ = 4
_PEEK_BYTES = 7
# Scalars inside the compiled functions are numpy int64s (numba ignores these hints).
Int = int | np.int64
if _PER_READ * MAX_CODE_LEN > 8 * _PEEK_BYTES - 7:
    raise ImportError("numba_decoder: a 56-bit read no longer holds four codewords")


@njit(nogil=True, cache=True, inline="always")
def _peek(bits: np.ndarray, pos: Int, last: Int) -> Int:
    """At least 49 bits of ``bits`` from bit ``pos`` on, LSB first (higher bits are junk)."""
    # min(): crafted offsets must not read past the stream (PAD_BYTES >= _PEEK_BYTES).
    p = min(pos >> 3, last)
    # Written out so that LLVM merges the loads into one unaligned 64-bit load.
    x = (
        np.int64(bits[p])
        | (np.int64(bits[p + 1]) << 8)
        | (np.int64(bits[p + 2]) << 16)
        | (np.int64(bits[p + 3]) << 24)
        | (np.int64(bits[p + 4]) << 32)
        | (np.int64(bits[p + 5]) << 40)
        | (np.int64(bits[p + 6]) << 48)
    )
    return x >> (pos & 7)


@njit(nogil=True, cache=True, inline="always")
def _emit(
    table: np.ndarray,
    mask: Int,
    window: Int,
    raw: np.ndarray,
    i: Int,
    rotate: bool,
    out: np.ndarray,
) -> Int:
    """Decode the codeword at the bottom of ``window`` into ``out[i]``; returns its length."""
    entry = np.int64(table[window & mask])
    word = ((entry & 0xFF) << 8) | np.int64(raw[i])
    if rotate:
        # bf16: undo the encoder's rotate-left (eeeeeeee mmmmmmms -> s eeeeeeee mmmmmmm).
        word = (word >> 1) | ((word & 1) << 15)
    out[i] = word
    return entry >> 8


@njit(nogil=True, cache=True)
def _decode_chunk(
    bits: np.ndarray,
    pos: Int,
    raw: np.ndarray,
    table: np.ndarray,
    mask: Int,
    i: Int,
    end: Int,
    rotate: bool,
    out: np.ndarray,
) -> None:
    """One chunk alone (symbols ``i`` to ``end``): the chunks left over by the 4-lane loop."""
    last = bits.size - _PEEK_BYTES
    while i < end:
        window = _peek(bits, pos, last)
        for _ in range(min(_PER_READ, end - i)):
            length = _emit(table, mask, window, raw, i, rotate, out)
            window >>= length
            pos += length
            i += 1


@njit(nogil=True, cache=True)
def _decode_stream(
    bits: np.ndarray,
    offsets: np.ndarray,
    raw: np.ndarray,
    table: np.ndarray,
    max_len: Int,
    chunk: Int,
    rotate: bool,
    out: np.ndarray,
) -> None:
    """Decode every chunk of one word stream into ``out`` (uint16, the final words)."""
    n = raw.size
    mask = (1 << max_len) - 1
    last = bits.size - _PEEK_BYTES
    groups = n // chunk // 4  # groups of four full chunks
    for g in range(groups):
        c = 4 * g
        pa, pb = np.int64(offsets[c]) * 8, np.int64(offsets[c + 1]) * 8
        pc, pd = np.int64(offsets[c + 2]) * 8, np.int64(offsets[c + 3]) * 8
        first = c * chunk
        for step in range(0, chunk, _PER_READ):
            wa, wb = _peek(bits, pa, last), _peek(bits, pb, last)
            wc, wd = _peek(bits, pc, last), _peek(bits, pd, last)
            for k in range(min(_PER_READ, chunk - step)):
                i = first + step + k
                la = _emit(table, mask, wa, raw, i, rotate, out)
                lb = _emit(table, mask, wb, raw, i + chunk, rotate, out)
                lc = _emit(table, mask, wc, raw, i + 2 * chunk, rotate, out)
                ld = _emit(table, mask, wd, raw, i + 3 * chunk, rotate, out)
                wa, wb, wc, wd = wa >> la, wb >> lb, wc >> lc, wd >> ld
                pa, pb, pc, pd = pa + la, pb + lb, pc + lc, pd + ld
    for c in range(4 * groups, offsets.size):
        start = c * chunk
        pos = np.int64(offsets[c]) * 8
        _decode_chunk(bits, pos, raw, table, mask, start, min(start + chunk, n), rotate, out)


@njit(nogil=True, cache=True, inline="always")
def _field(packed: np.ndarray, k: Int, width: Int) -> Int:
    """Field ``k`` of ``width`` bits (see ``palette.pack_fields``): one two-byte read."""
    bit = k * width
    two = np.int64(packed[bit >> 3]) | (np.int64(packed[(bit >> 3) + 1]) << 8)
    return (two >> (bit & 7)) & ((1 << width) - 1)


@njit(nogil=True, cache=True)
def _gather(
    palette: np.ndarray,
    counts: np.ndarray,
    index: np.ndarray,
    width: Int,
    block: Int,
    count_bits: Int,
    out: np.ndarray,
) -> None:
    """Palette lookup of every element into ``out`` (uint16)."""
    n = out.size
    last = palette.size - 1
    start: Int = 0
    for b in range((n + block - 1) // block):
        for i in range(b * block, min(b * block + block, n)):
            # min(): a position past the palette (crafted input only) must stay in bounds.
            out[i] = palette[min(start + _field(index, i, width), last)]
        start += _field(counts, b, count_bits) + 1


def decode_words_numba(tensor: CompressedTensor) -> np.ndarray:
    """The flat uint16 words of one CPU-resident tensor."""
    stream = tensor.stream()
    table, max_len = decode_table(stream.code.numpy())
    words = np.empty(stream.raw.numel(), dtype=np.uint16)
    _decode_stream(
        stream.bits.numpy(),
        stream.offsets.numpy(),
        stream.raw.numpy(),
        table,
        max_len,
        stream.chunk,
        stream.dtype == "bfloat16",
        words,
    )
    fields = tensor.palette
    if fields is None:
        return words
    out = np.empty(tensor.numel, dtype=np.uint16)
    counts, index = fields.counts.numpy(), fields.index.numpy()
    _gather(words, counts, index, fields.width, fields.block, COUNT_BITS, out)
    return out
