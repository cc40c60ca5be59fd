"""Palette mode: blocks of consecutive elements that hold few distinct words.

Weights dequantized from a group-quantized checkpoint (GGUF Q4_*, GPTQ, AWQ...) take at most
2**b distinct values in every group of consecutive elements: SmolLM2's built-in Q4_1 layers hold
at most 16 distinct bf16 words per 32 (12.5 on average). Huffman-coding exponents cannot see that,
but storing each block's distinct words once plus a small index per element can: about 8.4 bits
per element instead of 10.6. The encoder tries it on every tensor and keeps it only where the
data make it smaller (see ``encoder.py``); nothing depends on where the weights came from.

A palette-mode tensor of ``n`` elements in blocks of ``block`` elements stores:

* the palette words, each block's distinct words in increasing order, blocks in order, as the
  tensor's Huffman-coded word stream (``code``/``offsets``/``bits``/``raw``, as in plain mode);
* ``counts``: each block's palette size minus one, ``COUNT_BITS`` bits per block;
* ``index``: per element, the position of its word in its block's palette, ``width`` bits each.

Both are fixed-width bit fields packed LSB-first followed by ``FIELD_PAD`` zero bytes, so a
decoder reads any field with one two-byte load and no bounds test: element ``i`` is random access,
which keeps GPU decoding one thread per element.
"""

from __future__ import annotations

import numpy as np

MAX_PALETTE = 16
COUNT_BITS = 4
FIELD_PAD = 2
# Quantization groups in use: 32 (GGUF, AWQ), 64, 128 (GPTQ), 256 (GGUF K-quant super-blocks).
BLOCK_SIZES = (32, 64, 128, 256)


def field_bytes(count: int, width: int, pad: int = FIELD_PAD) -> int:
    """Stored size of ``count`` packed ``width``-bit fields, ``pad`` bytes of padding included."""
    return (count * width + 7) // 8 + pad


def pack_fields(values: np.ndarray, width: int, pad: int = FIELD_PAD) -> np.ndarray:
    """Pack non-negative ints (each < 2**width) LSB-first into uint8, then ``pad`` zero bytes."""
    out = np.zeros(field_bytes(len(values), width, pad), dtype=np.uint8)
    if width and len(values):
        bits = (values.astype(np.uint16)[:, None] >> np.arange(width, dtype=np.uint16)) & 1
        packed = np.packbits(bits.astype(np.uint8).reshape(-1), bitorder="little")
        out[: len(packed)] = packed
    return out


def unpack_fields(packed: np.ndarray, width: int, count: int) -> np.ndarray:
    """The first ``count`` ``width``-bit fields of ``packed`` (int64); inverse of pack_fields."""
    if width == 0:
        return np.zeros(count, dtype=np.int64)
    bit = np.arange(count, dtype=np.int64) * width
    two = packed[bit >> 3].astype(np.int64) | (packed[(bit >> 3) + 1].astype(np.int64) << 8)
    return (two >> (bit & 7)) & ((1 << width) - 1)


def n_blocks(numel: int, block: int) -> int:
    return -(-numel // block)


def split(words: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Palettes of ``words`` (uint16, n > 0) in blocks of ``block``, or None past MAX_PALETTE.

    Returns (palette words uint16, counts (per block, >= 1), index (per element)).
    """
    n = len(words)
    blocks = n_blocks(n, block)
    # Pad the last block with copies of its last word: a repeat adds no palette entry.
    padded = np.concatenate([words, np.repeat(words[-1:], blocks * block - n)])
    padded = padded.reshape(blocks, block)
    order = np.argsort(padded, axis=1, kind="stable")
    ordered = np.take_along_axis(padded, order, axis=1)
    first = np.ones_like(ordered, dtype=bool)
    first[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    counts = first.sum(axis=1)
    if counts.max() > MAX_PALETTE:
        return None
    index = np.empty(padded.shape, dtype=np.int64)
    np.put_along_axis(index, order, np.cumsum(first, axis=1) - 1, axis=1)
    return ordered[first], counts, index.reshape(-1)[:n]


def estimate_bytes(numel: int, block: int, counts: np.ndarray, word_bytes: float) -> float:
    """Palette-mode size when a palette word costs ``word_bytes`` (its plain-mode cost)."""
    width = int(counts.max() - 1).bit_length()
    return (
        field_bytes(numel, width)
        + field_bytes(n_blocks(numel, block), COUNT_BITS)
        + float(counts.sum()) * word_bytes
    )


def gather(
    palette: np.ndarray, counts: np.ndarray, index: np.ndarray, block: int, numel: int
) -> np.ndarray:
    """Vectorised palette lookup: the ``numel`` words (numpy fallback of the compiled path).

    ``counts``/``index`` are unpacked fields (count - 1 per block, position per element). A
    position past the palette (only in crafted input) is clamped, so reads stay in bounds.
    """
    sizes = counts + 1
    starts = np.cumsum(sizes) - sizes
    where = np.repeat(starts, block)[:numel] + index
    np.minimum(where, len(palette) - 1, out=where)
    return palette[where]
