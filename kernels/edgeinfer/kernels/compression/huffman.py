"""Canonical, length-limited Huffman codes over byte symbols, and their lookup tables.

A code is stored as ``pairs``: a uint8 array ``[sym0, len0, sym1, len1, ...]`` listing only the
symbols that occur, in increasing symbol order. A tensor whose coded bytes are all equal has a
single pair with length 0: it costs no bits at all, and both decoders handle it with no special
case (every lookup returns that symbol and consumes nothing).

Bits are written LSB-first (as in DEFLATE), so a decoder peeks the next ``max_len`` bits with a
shift and a mask; each codeword is therefore stored bit-reversed.
"""

from __future__ import annotations

import numpy as np

from edgeinfer.kernels.compression.errors import CorruptDataError

# 12 bits keeps the single-symbol table at 4096 entries (8 KiB: fits a GPU's L1 or shared
# memory); on trained weights it costs under 0.01 bit per symbol against unlimited Huffman.
MAX_CODE_LEN = 12


def code_lengths(counts: np.ndarray, max_len: int = MAX_CODE_LEN) -> np.ndarray:
    """Optimal code lengths (uint8, shape (256,)) with none above ``max_len``: package-merge.

    ``counts`` holds the number of occurrences of each byte value (shape (256,)).
    """
    symbols = np.flatnonzero(counts)
    lengths = np.zeros(256, dtype=np.uint8)
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


def pairs_to_lengths(pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Validate stored ``pairs`` and return (symbols, lengths) as int64 arrays.

    A complete prefix code is required (Kraft sum exactly 1), so every bit pattern a decoder
    peeks maps to a symbol and no table entry is left undefined.
    """
    if pairs.ndim != 1 or len(pairs) == 0 or len(pairs) % 2:
        raise CorruptDataError("Huffman code table has an invalid size")
    symbols = pairs[0::2].astype(np.int64)
    lengths = pairs[1::2].astype(np.int64)
    if np.any(np.diff(symbols) <= 0) or lengths.max() > MAX_CODE_LEN:
        raise CorruptDataError("Huffman code table is malformed")
    single = len(symbols) == 1 and lengths[0] == 0
    kraft = int(np.sum(1 << (MAX_CODE_LEN - lengths[lengths > 0])))
    if not single and (np.any(lengths == 0) or kraft != 1 << MAX_CODE_LEN):
        raise CorruptDataError("Huffman code table is not a complete prefix code")
    return symbols, lengths


def canonical_codes(symbols: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Bit-reversed canonical codewords, indexed by symbol (uint32, shape (256,))."""
    codes = np.zeros(256, dtype=np.uint32)
    code = 0
    prev_len = 0
    # Canonical order: by length, then by symbol (symbols are already increasing).
    for i in np.lexsort((symbols, lengths)):
        length = int(lengths[i])
        code <<= length - prev_len
        prev_len = length
        reversed_code = int(f"{code:0{length}b}"[::-1], 2) if length else 0
        codes[symbols[i]] = reversed_code
        code += 1
    return codes


def decode_table(pairs: np.ndarray) -> tuple[np.ndarray, int]:
    """Single-symbol table: ``table[next max_len bits] = symbol | code_length << 8`` (uint16).

    Returns the table (shape (2**max_len,)) and ``max_len``.
    """
    symbols, lengths = pairs_to_lengths(pairs)
    max_len = int(lengths.max())
    codes = canonical_codes(symbols, lengths)
    table = np.zeros(1 << max_len, dtype=np.uint16)
    for sym, length in zip(symbols.tolist(), lengths.tolist(), strict=True):
        # Every index whose low `length` bits equal the codeword decodes to `sym`.
        table[int(codes[sym]) :: 1 << length] = sym | (length << 8)
    return table, max_len
