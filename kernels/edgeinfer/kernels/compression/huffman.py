"""Canonical, length-limited Huffman codes over small-integer symbols, and their lookup tables.

A code is stored in one of two uint8 layouts, both listing only the symbols that occur:

* ``pairs`` (symbols are bytes): ``[sym0, len0, sym1, len1, ...]`` in increasing symbol order;
* ``range`` (symbols up to ``MAX_SYMBOL``): ``[lo & 0xFF, lo >> 8]`` then one 4-bit length per
  symbol ``lo, lo + 1, ...`` (two per byte, low nibble first), 0 meaning "does not occur". The
  symbols of a tensor's extended stream (exponent plus top mantissa bits) fill a contiguous range
  densely, so this costs half a byte per symbol instead of the three a pair list would need.

A tensor whose symbols are all equal has a single symbol with length 0 (in ``range`` layout: all
lengths 0, the symbol is ``lo``): it costs no bits at all, and the decoders handle it with no
special case (every lookup returns that symbol and consumes nothing).

Bits are written LSB-first (as in DEFLATE), so a decoder peeks the next ``max_len`` bits with a
shift and a mask; each codeword is therefore stored bit-reversed.
"""

from __future__ import annotations

import numpy as np

from edgeinfer.kernels.compression.errors import CorruptDataError

# 12 bits keeps the single-symbol table at 4096 entries (16 KiB: fits a GPU's L1 or shared
# memory); on trained weights it costs under 0.01 bit per symbol against unlimited Huffman.
MAX_CODE_LEN = 12
# Symbols of the range layout: an exponent byte plus at most 3 mantissa bits.
MAX_SYMBOL = (1 << 11) - 1
# Distinct symbols a code may hold, so that a symbol's rank fits a byte (numpy decoder).
MAX_SYMBOLS = 256
# Decode table entries are ``symbol | length << LENGTH_SHIFT`` (int32).
LENGTH_SHIFT = 16


def code_lengths(counts: np.ndarray, max_len: int = MAX_CODE_LEN) -> np.ndarray:
    """Optimal code lengths (uint8, shaped like ``counts``), none above ``max_len``: package-merge.

    ``counts`` holds the number of occurrences of each symbol value.
    """
    symbols = np.flatnonzero(counts)
    lengths = np.zeros(len(counts), dtype=np.uint8)
    if len(symbols) <= 1:
        return lengths  # one symbol (or none): length 0, see the module docstring
    if len(symbols) > 1 << max_len:
        raise ValueError(f"{len(symbols)} symbols cannot be coded in {max_len} bits")
    # Each item is (weight, per-symbol occurrence vector); a symbol's code length is the number
    # of times it appears among the 2n-2 lightest items of the last list (Larmore & Hirschberg).
    eye = np.eye(len(symbols), dtype=np.int64)
    leaves = sorted(((int(counts[s]), i) for i, s in enumerate(symbols)), key=lambda item: item[0])
    leaf_items = [(w, eye[i]) for w, i in leaves]
    items = leaf_items
    for _ in range(max_len - 1):
        packages = [
            (items[k][0] + items[k + 1][0], items[k][1] + items[k + 1][1])
            for k in range(0, len(items) - 1, 2)
        ]
        items = sorted(leaf_items + packages, key=lambda item: item[0])
    chosen = np.sum([vec for _, vec in items[: 2 * len(symbols) - 2]], axis=0)
    lengths[symbols] = chosen
    return lengths


def lengths_to_pairs(lengths: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Pack the lengths of the symbols that occur into the stored ``pairs`` layout."""
    symbols = np.flatnonzero(counts).astype(np.uint8)
    return np.stack([symbols, lengths[symbols]], axis=1).reshape(-1)


def range_code(lengths: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The ``range`` layout of a code over symbols ``0..len(counts)-1`` (uint8)."""
    present = np.flatnonzero(counts)
    lo = int(present[0])
    nibbles = lengths[lo : int(present[-1]) + 1].astype(np.uint8)
    if len(nibbles) % 2:
        nibbles = np.append(nibbles, np.uint8(0))
    packed = nibbles[0::2] | (nibbles[1::2] << 4)
    return np.concatenate([np.array([lo & 0xFF, lo >> 8], dtype=np.uint8), packed])


def pairs_to_lengths(pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Validate stored ``pairs`` and return (symbols, lengths) as int64 arrays."""
    if pairs.ndim != 1 or len(pairs) == 0 or len(pairs) % 2:
        raise CorruptDataError("Huffman code table has an invalid size")
    symbols = pairs[0::2].astype(np.int64)
    if np.any(np.diff(symbols) <= 0):
        raise CorruptDataError("Huffman code table is malformed")
    return _checked(symbols, pairs[1::2].astype(np.int64))


def range_to_lengths(code: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Validate a stored ``range`` code and return (symbols, lengths) as int64 arrays."""
    if code.ndim != 1 or len(code) < 3:
        raise CorruptDataError("Huffman code table has an invalid size")
    lo = int(code[0]) | int(code[1]) << 8
    nibbles = np.empty(2 * (len(code) - 2), dtype=np.int64)
    nibbles[0::2] = code[2:] & 0xF
    nibbles[1::2] = code[2:] >> 4
    present = np.flatnonzero(nibbles)
    if len(present) == 0:
        symbols, lengths = np.array([lo]), np.zeros(1, dtype=np.int64)  # the one-symbol code
    else:
        symbols, lengths = present + lo, nibbles[present]
    if symbols[-1] > MAX_SYMBOL or len(symbols) > MAX_SYMBOLS:
        raise CorruptDataError("Huffman code table is malformed")
    return _checked(symbols, lengths)


def _checked(symbols: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Require a complete prefix code (Kraft sum exactly 1) of lengths <= MAX_CODE_LEN.

    Then every bit pattern a decoder peeks maps to a symbol and no table entry is undefined.
    """
    # Few numpy calls: this runs once per decoded tensor, and small tensors are common.
    if int(lengths.max()) > MAX_CODE_LEN:
        raise CorruptDataError("Huffman code table is malformed")
    if len(symbols) == 1 and lengths[0] == 0:
        return symbols, lengths  # the one-symbol code
    if int(lengths.min()) == 0 or int((1 << (MAX_CODE_LEN - lengths)).sum()) != 1 << MAX_CODE_LEN:
        raise CorruptDataError("Huffman code table is not a complete prefix code")
    return symbols, lengths


def canonical_codes(symbols: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Bit-reversed canonical codewords of ``symbols`` (uint32, aligned with ``symbols``)."""
    codes = np.zeros(len(symbols), dtype=np.uint32)
    code = 0
    prev_len = 0
    # Canonical order: by length, then by symbol (symbols are already increasing).
    for i in np.lexsort((symbols, lengths)):
        length = int(lengths[i])
        code <<= length - prev_len
        prev_len = length
        codes[i] = int(f"{code:0{length}b}"[::-1], 2) if length else 0
        code += 1
    return codes


def decode_table(symbols: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, int]:
    """Single-symbol table: ``table[next max_len bits] = symbol | length << LENGTH_SHIFT``.

    Returns the table (int32, shape (2**max_len,)) and ``max_len``. Built without a loop over
    symbols: in canonical order the codewords, read MSB first, tile the ``max_len``-bit space in
    order, each over ``2**(max_len - length)`` entries; the stream is LSB first, so the table is
    that tiling indexed by the bit-reversed window.
    """
    max_len = int(lengths.max())
    order = np.lexsort((symbols, lengths))
    entries = (symbols[order] | (lengths[order] << LENGTH_SHIFT)).astype(np.int32)
    msb_first = np.repeat(entries, 1 << (max_len - lengths[order]))
    return msb_first[_bit_reversal(max_len)], max_len


def _bit_reversal(bits: int) -> np.ndarray:
    """``r[i]`` = ``i`` with its low ``bits`` bits reversed (cached: one array per width)."""
    if bits not in _REVERSALS:
        r = np.zeros(1 << bits, dtype=np.int64)
        i = np.arange(1 << bits)
        for b in range(bits):
            r |= ((i >> b) & 1) << (bits - 1 - b)
        _REVERSALS[bits] = r
    return _REVERSALS[bits]


_REVERSALS: dict[int, np.ndarray] = {}
