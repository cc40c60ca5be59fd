"""Compiled CPU decoder (numba): table-driven Huffman decoding of four chunks at a time.

Decoding one chunk is a chain of dependent steps (the next codeword starts where this one ends),
so a single chunk leaves most of a core idle; the loop therefore advances four chunks side by
side, whose chains overlap. Per group of four codewords a lane reads 56 bits at its bit position
with seven byte loads (no bit buffer to refill, hence no unpredictable refill branch); shifted
by the position's bit offset, at least 49 bits remain, enough for four codewords of at most
``MAX_CODE_LEN`` (12) bits. The lane's four raw fields (at most 4 * 8 bits) come from one such
read of ``raw`` as well. Each codeword costs one lookup in the single-symbol table
(``symbol | length << 16``), is joined with its raw field and written as the final 16-bit word
in the same pass. Palette-mode tensors then look their words up with a loop over elements.

The functions are compiled on first use and cached on disk (``cache=True``), and release the GIL
(``nogil=True``) so that callers may decode several tensors on several threads.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from edgeinfer.kernels.compression.format import PAD_BYTES, CompressedTensor
from edgeinfer.kernels.compression.huffman import LENGTH_SHIFT, MAX_CODE_LEN, decode_table
from edgeinfer.kernels.compression.palette import COUNT_BITS, MAX_PALETTE

# Codewords decoded per 56-bit read: 4 * 12 <= 56 - 7.
_PER_READ = 4
_PEEK_BYTES = 7
_LENGTH_SHIFT = LENGTH_SHIFT
# Scalars inside the compiled functions are numpy int64s (numba ignores these hints).
Int = int | np.int64
if _PER_READ * MAX_CODE_LEN > 8 * _PEEK_BYTES - 7:
    raise ImportError("numba_decoder: a 56-bit read no longer holds four codewords")


@njit(nogil=True, cache=True, inline="always")
def _peek(bits: np.ndarray, pos: Int, last: Int) -> Int:
    """At least 49 bits of ``bits`` from bit ``pos`` on, LSB first (higher bits are junk)."""
    # min(): crafted offsets must not read past the stream (PAD_BYTES >= _PEEK_BYTES). Unsigned
    # indices spare numba's test for negative (wrap-around) indices on each of the loads.
    p = np.uint64(min(pos >> 3, last))
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
    low: np.ndarray,
    field: Int,
    raw_mask: Int,
    i: Int,
    out: np.ndarray,
) -> Int:
    """Decode the codeword at the bottom of ``window``, joined with the raw ``field``, into
    ``out[i]``; returns the codeword's length.

    Table entries and ``low`` already hold their bits where the final word has them (see
    ``_word_tables``), so a word is one OR; the store into uint16 drops the length bits.
    """
    entry = np.int64(table[np.uint64(window & mask)])
    out[np.uint64(i)] = entry | low[np.uint64(field & raw_mask)]
    return entry >> _LENGTH_SHIFT


@njit(nogil=True, cache=True, inline="always")
def _start(offsets: np.ndarray, c: Int, acc: Int, sizes: bool) -> Int:
    """Bit position of chunk ``c``: ``acc`` (running sum of sizes) or its stored offset."""
    return acc * 8 if sizes else np.int64(offsets[c]) * 8


@njit(nogil=True, cache=True)
def _decode_stream(
    bits: np.ndarray,
    offsets: np.ndarray,
    sizes: bool,
    raw: np.ndarray,
    raw_bits: Int,
    table: np.ndarray,
    max_len: Int,
    low: np.ndarray,
    chunk: Int,
    out: np.ndarray,
) -> None:
    """Decode every chunk of one word stream into ``out`` (uint16, the final words).

    ``offsets`` holds chunk start offsets, or chunk sizes when ``sizes`` (extended streams);
    ``raw`` is followed by at least ``PAD_BYTES`` bytes so that any field may be peeked.
    """
    n = out.size
    mask = (1 << max_len) - 1
    last = bits.size - _PEEK_BYTES
    raw_last = raw.size - _PEEK_BYTES
    raw_mask = (1 << raw_bits) - 1
    acc: Int = 0  # sum of the sizes of the chunks before the next one
    # Groups of four full chunks; a chunk size that is not a multiple of four (tests only) decodes
    # one chunk at a time, so that the inner loop has a fixed trip count and unrolls.
    groups = n // chunk // 4 if chunk % _PER_READ == 0 else 0
    for g in range(groups):
        c = 4 * g
        pa = _start(offsets, c, acc, sizes)
        acc += np.int64(offsets[c]) if sizes else 0
        pb = _start(offsets, c + 1, acc, sizes)
        acc += np.int64(offsets[c + 1]) if sizes else 0
        pc = _start(offsets, c + 2, acc, sizes)
        acc += np.int64(offsets[c + 2]) if sizes else 0
        pd = _start(offsets, c + 3, acc, sizes)
        acc += np.int64(offsets[c + 3]) if sizes else 0
        first = c * chunk
        for step in range(0, chunk, _PER_READ):
            wa, wb = _peek(bits, pa, last), _peek(bits, pb, last)
            wc, wd = _peek(bits, pc, last), _peek(bits, pd, last)
            i = first + step
            ra = _peek(raw, i * raw_bits, raw_last)
            rb = _peek(raw, (i + chunk) * raw_bits, raw_last)
            rc = _peek(raw, (i + 2 * chunk) * raw_bits, raw_last)
            rd = _peek(raw, (i + 3 * chunk) * raw_bits, raw_last)
            for _ in range(_PER_READ):
                la = _emit(table, mask, wa, low, ra, raw_mask, i, out)
                lb = _emit(table, mask, wb, low, rb, raw_mask, i + chunk, out)
                lc = _emit(table, mask, wc, low, rc, raw_mask, i + 2 * chunk, out)
                ld = _emit(table, mask, wd, low, rd, raw_mask, i + 3 * chunk, out)
                wa, wb, wc, wd = wa >> la, wb >> lb, wc >> lc, wd >> ld
                pa, pb, pc, pd = pa + la, pb + lb, pc + lc, pd + ld
                ra, rb, rc, rd = ra >> raw_bits, rb >> raw_bits, rc >> raw_bits, rd >> raw_bits
                i += 1
    # The chunks left over by the 4-lane loop, one at a time.
    for c in range(4 * groups, offsets.size):
        pos = _start(offsets, c, acc, sizes)
        acc += np.int64(offsets[c]) if sizes else 0
        i, end = c * chunk, min(c * chunk + chunk, n)
        while i < end:
            window = _peek(bits, pos, last)
            field = _peek(raw, i * raw_bits, raw_last)
            for _ in range(min(_PER_READ, end - i)):
                length = _emit(table, mask, window, low, field, raw_mask, i, out)
                window >>= length
                field >>= raw_bits
                pos += length
                i += 1


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
    """Palette lookup of every element into ``out`` (uint16).

    Index fields are read eight at a time (at most 32 bits, byte-aligned as blocks hold a
    multiple of 8 elements) with one merged load. ``palette`` is followed by ``MAX_PALETTE``
    spare words, so a position past a block's palette (crafted input only: an index is at most
    15) stays in bounds without a test per element.
    """
    n = out.size
    start: Int = 0
    last = palette.size - MAX_PALETTE
    mask = (1 << width) - 1
    for b in range((n + block - 1) // block):
        base = min(start, last)
        i = b * block
        end = min(i + block, n)
        if width == 0:
            out[i:end] = palette[base]
        else:
            while i + 8 <= end:
                p = np.uint64((i * width) >> 3)
                x = (
                    np.int64(index[p])
                    | (np.int64(index[p + 1]) << 8)
                    | (np.int64(index[p + 2]) << 16)
                    | (np.int64(index[p + 3]) << 24)
                )
                for j in range(8):
                    out[np.uint64(i + j)] = palette[np.uint64(base + ((x >> (j * width)) & mask))]
                i += 8
            for k in range(i, end):
                out[k] = palette[base + _field(index, k, width)]
        start += _field(counts, b, count_bits) + 1


def _word_tables(table: np.ndarray, raw_bits: int, rotate: bool) -> tuple[np.ndarray, np.ndarray]:
    """The decode table and a raw-field table whose entries OR into the final 16-bit word.

    A word is ``symbol << raw_bits | field``; bf16 then undoes the encoder's rotate-left
    (eeeeeeee mmmmmmms -> s eeeeeeee mmmmmmm), which moves the symbol right by one bit and the
    field's low bit (the sign) to bit 15. Both moves are applied to the tables once per tensor
    instead of to every word.
    """
    shift = raw_bits - 1 if rotate else raw_bits
    length = (table >> LENGTH_SHIFT) << LENGTH_SHIFT
    word_table = (((table & 0xFFFF) << shift) & 0xFFFF) | length
    field = np.arange(1 << raw_bits, dtype=np.int32)
    low = (field >> 1) | ((field & 1) << 15) if rotate else field
    return word_table.astype(np.int32), low.astype(np.uint16)


def decode_words_numba(tensor: CompressedTensor) -> np.ndarray:
    """The flat uint16 words of one CPU-resident tensor."""
    stream = tensor.stream()
    table, max_len = decode_table(*stream.code_lengths())
    table, low = _word_tables(table, stream.raw_bits, stream.dtype == "bfloat16")
    raw = stream.raw.numpy()
    if stream.extra_bits == 0:
        raw = np.concatenate([raw, np.zeros(PAD_BYTES, np.uint8)])  # format 1: no padding
    fields = tensor.palette
    # Palette words get MAX_PALETTE spare entries (see _gather).
    words = np.zeros(stream.stream_words + (MAX_PALETTE if fields else 0), dtype=np.uint16)
    _decode_stream(
        stream.bits.numpy(),
        stream.offsets.numpy(),
        stream.extra_bits > 0,
        raw,
        stream.raw_bits,
        table,
        max_len,
        low,
        stream.chunk,
        words[: stream.stream_words],
    )
    if fields is None:
        return words
    out = np.empty(tensor.numel, dtype=np.uint16)
    counts, index = fields.counts.numpy(), fields.index.numpy()
    _gather(words, counts, index, fields.width, fields.block, COUNT_BITS, out)
    return out
