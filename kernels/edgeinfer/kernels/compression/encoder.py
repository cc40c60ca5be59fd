"""Compress one bf16/fp16 tensor into a :class:`CompressedTensor` (vectorised numpy).

Each tensor gets the smaller of the two modes (see ``format.py``): plain, or palette when every
block of some size in ``palette.BLOCK_SIZES`` holds at most ``MAX_PALETTE`` distinct words and
that wins on this tensor's data.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from edgeinfer.kernels.compression.errors import CompressionError
from edgeinfer.kernels.compression.format import (
    DEFAULT_CHUNK,
    DTYPES,
    PAD_BYTES,
    CompressedTensor,
    Palette,
)
from edgeinfer.kernels.compression.huffman import (
    canonical_codes,
    code_lengths,
    lengths_to_pairs,
    pairs_to_lengths,
)
from edgeinfer.kernels.compression.palette import (
    BLOCK_SIZES,
    COUNT_BITS,
    estimate_bytes,
    pack_fields,
    split,
)


def split_words(words: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Map uint16 words (n,) to (coded bytes, raw bytes), each uint8 (n,); see ``format.py``."""
    if dtype == "bfloat16":
        words = (words << 1) | (words >> 15)  # rotate left: eeeeeeee mmmmmmms
    return (words >> 8).astype(np.uint8), (words & 0xFF).astype(np.uint8)


def exponent_entropy_bits(coded: np.ndarray) -> float:
    """Shannon entropy of the coded bytes in bits per symbol: the bound for any per-tensor code."""
    counts = np.bincount(coded, minlength=256)
    p = counts[counts > 0] / max(len(coded), 1)
    return float(-(p * np.log2(p)).sum())


def compress_tensor(tensor: torch.Tensor, chunk: int = DEFAULT_CHUNK) -> CompressedTensor:
    """Compress a bf16 or fp16 tensor of any shape (contiguous or not) losslessly."""
    dtype = next((name for name, dt in DTYPES.items() if dt == tensor.dtype), None)
    if dtype is None:
        raise CompressionError(
            f"only bfloat16 and float16 tensors are compressed, not {tensor.dtype}"
        )
    if chunk <= 0:
        raise CompressionError(f"chunk must be positive, got {chunk}")
    words = tensor.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16).ravel()
    shape = tuple(tensor.shape)
    plain = _encode_stream(words, dtype, shape, chunk)
    palette = _best_palette(words, plain.nbytes / max(len(words), 1))
    if palette is None:
        return plain
    block, (palette_words, counts, index) = palette
    stream = _encode_stream(palette_words, dtype, shape, chunk)
    width = int(counts.max() - 1).bit_length()
    fields = Palette(
        block,
        width,
        torch.from_numpy(pack_fields(counts - 1, COUNT_BITS)),
        torch.from_numpy(pack_fields(index, width)),
    )
    packed = dataclasses.replace(stream, palette=fields)
    return packed if packed.nbytes < plain.nbytes else plain


def _best_palette(
    words: np.ndarray, word_bytes: float
) -> tuple[int, tuple[np.ndarray, np.ndarray, np.ndarray]] | None:
    """The block size whose palette split looks smallest, with that split; None if none fits.

    A palette word is costed at ``word_bytes``, its plain-mode cost: close enough to rank the
    block sizes, and the caller compares the exact sizes of the winner and of plain mode.
    """
    best: tuple[float, int, tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None
    if len(words) == 0:
        return None
    for block in BLOCK_SIZES:
        parts = split(words, block)
        if parts is None:
            break  # a larger block holds at least as many distinct words
        size = estimate_bytes(len(words), block, parts[1], word_bytes)
        if best is None or size < best[0]:
            best = (size, block, parts)
    return None if best is None else (best[1], best[2])


def _encode_stream(
    words: np.ndarray, dtype: str, shape: tuple[int, ...], chunk: int
) -> CompressedTensor:
    """Plain-mode tensor of ``words`` (uint16) with the given shape (fixed by the caller)."""
    coded, raw = split_words(words, dtype)
    counts = np.bincount(coded, minlength=256)
    pairs = lengths_to_pairs(code_lengths(counts), counts) if len(coded) else np.zeros(2, np.uint8)
    symbols, lengths = pairs_to_lengths(pairs)
    offsets, bits = _encode_chunks(coded, symbols, lengths, chunk)
    return CompressedTensor(
        dtype=dtype,
        shape=shape,
        chunk=chunk,
        code=torch.from_numpy(pairs),
        offsets=torch.from_numpy(offsets),
        bits=torch.from_numpy(bits),
        raw=torch.from_numpy(raw),
    )


def _encode_chunks(
    coded: np.ndarray, symbols: np.ndarray, lengths: np.ndarray, chunk: int
) -> tuple[np.ndarray, np.ndarray]:
    """Huffman-code ``coded`` (n,) in byte-aligned chunks; returns (offsets (C,), bits (B,))."""
    n = len(coded)
    n_chunks = -(-n // chunk)
    length_of = np.zeros(256, dtype=np.int64)
    length_of[symbols] = lengths
    sym_len = length_of[coded]
    # Bits per chunk, rounded up to whole bytes so that every chunk starts byte-aligned.
    padded = np.zeros(n_chunks * chunk, dtype=np.int64)
    padded[:n] = sym_len
    chunk_bits = padded.reshape(n_chunks, chunk).sum(axis=1)
    chunk_bytes = (chunk_bits + 7) >> 3
    starts = np.concatenate([[0], np.cumsum(chunk_bytes)])
    if starts[-1] >= 2**31:
        raise CompressionError("tensor too large: its coded stream exceeds 2 GiB")
    # First bit of each symbol: its chunk's start plus the bits of earlier symbols in the chunk.
    within = np.cumsum(padded.reshape(n_chunks, chunk), axis=1) - padded.reshape(n_chunks, chunk)
    bit_pos = (within + (starts[:-1, None] << 3)).reshape(-1)[:n]
    n_words = int(starts[-1] + PAD_BYTES + 3) // 4
    codes = canonical_codes(symbols, lengths).astype(np.int64)[coded]
    # Codewords (<= 12 bits) never overlap, so OR-ing them into 32-bit words equals summing their
    # shifted values; bincount sums exactly in float64 since every partial sum is below 2**47.
    shifted = codes << (bit_pos & 31)
    word = bit_pos >> 5
    low = np.bincount(word, weights=shifted & 0xFFFFFFFF, minlength=n_words)
    high = np.bincount(word + 1, weights=shifted >> 32, minlength=n_words)
    words = (low[:n_words] + high[:n_words]).astype(np.uint32)
    bits = words.astype("<u4").view(np.uint8)[: starts[-1] + PAD_BYTES].copy()
    return starts[:-1].astype(np.int32), bits
