"""Compress one bf16/fp16 tensor into a :class:`CompressedTensor` (vectorised numpy).

Each tensor gets the smaller of the two modes (see ``format.py``): plain, or palette when every
block of some size in ``palette.BLOCK_SIZES`` holds at most ``MAX_PALETTE`` distinct words and
that wins on this tensor's data. Each word stream (the tensor's, or its palettes') in turn takes
the number of extra mantissa bits coded with the exponent that makes it smallest.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from edgeinfer.kernels.compression.errors import CompressionError
from edgeinfer.kernels.compression.format import (
    DEFAULT_CHUNK,
    DTYPES,
    MAX_EXTRA_BITS,
    PAD_BYTES,
    CompressedTensor,
    Palette,
)
from edgeinfer.kernels.compression.huffman import (
    MAX_CODE_LEN,
    MAX_SYMBOLS,
    canonical_codes,
    code_lengths,
    lengths_to_pairs,
    pairs_to_lengths,
    range_code,
    range_to_lengths,
)
from edgeinfer.kernels.compression.palette import (
    BLOCK_SIZES,
    COUNT_BITS,
    estimate_bytes,
    field_bytes,
    pack_fields,
    split,
)

# Extended streams store chunk sizes as int16: a chunk must fit 32767 bytes at worst.
_MAX_EXTENDED_CHUNK = (8 * 32767 - 7) // MAX_CODE_LEN


def split_words(
    words: np.ndarray, dtype: str, extra_bits: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Map uint16 words (n,) to (coded symbols, raw fields), see ``format.py``.

    With ``extra_bits`` 0 both are uint8 (coded byte, raw byte); otherwise the symbols are uint16
    and the raw fields (uint8) hold ``8 - extra_bits`` bits.
    """
    if dtype == "bfloat16":
        words = (words << 1) | (words >> 15)  # rotate left: eeeeeeee mmmmmmms
    raw_bits = 8 - extra_bits
    coded = words >> raw_bits
    raw = (words & ((1 << raw_bits) - 1)).astype(np.uint8)
    return (coded.astype(np.uint8) if extra_bits == 0 else coded), raw


def exponent_entropy_bits(coded: np.ndarray) -> float:
    """Shannon entropy of the coded bytes in bits per symbol: the bound for any per-tensor code."""
    counts = np.bincount(coded, minlength=256)
    p = counts[counts > 0] / max(len(coded), 1)
    return float(-(p * np.log2(p)).sum())


def compress_tensor(
    tensor: torch.Tensor, chunk: int = DEFAULT_CHUNK, extra_bits: int | None = None
) -> CompressedTensor:
    """Compress a bf16 or fp16 tensor of any shape (contiguous or not) losslessly.

    ``extra_bits`` forces the word streams' extra mantissa bits (0 gives format-1 streams); by
    default each stream takes the smallest.
    """
    dtype = next((name for name, dt in DTYPES.items() if dt == tensor.dtype), None)
    if dtype is None:
        raise CompressionError(
            f"only bfloat16 and float16 tensors are compressed, not {tensor.dtype}"
        )
    if chunk <= 0:
        raise CompressionError(f"chunk must be positive, got {chunk}")
    if extra_bits is not None and not 0 <= extra_bits <= MAX_EXTRA_BITS:
        raise CompressionError(f"extra_bits must be 0 to {MAX_EXTRA_BITS}, got {extra_bits}")
    words = tensor.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16).ravel()
    shape = tuple(tensor.shape)
    plain = _encode_stream(words, dtype, shape, chunk, extra_bits)
    palette = _best_palette(words, plain.nbytes / max(len(words), 1))
    if palette is None:
        return plain
    block, (palette_words, counts, index) = palette
    stream = _encode_stream(palette_words, dtype, shape, chunk, extra_bits)
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
    words: np.ndarray, dtype: str, shape: tuple[int, ...], chunk: int, force: int | None
) -> CompressedTensor:
    """Plain-mode tensor of ``words`` (uint16) with the given shape (fixed by the caller).

    The number of extra bits is ``force``, or else the one whose estimated size (code bits,
    chunk offsets, raw fields and table) is smallest; only that one is encoded.
    """
    extended = len(words) > 0 and chunk <= _MAX_EXTENDED_CHUNK
    if force and chunk > _MAX_EXTENDED_CHUNK:
        raise CompressionError(f"extra_bits {force} needs a chunk of at most {_MAX_EXTENDED_CHUNK}")
    tried = range(1 + MAX_EXTRA_BITS * extended) if force is None else [force * extended]
    options = [o for o in (_option(words, dtype, k, chunk) for k in tried) if o is not None]
    if not options:
        raise CompressionError(f"extra_bits {force}: more than {MAX_SYMBOLS} distinct symbols")
    _, extra_bits, code, coded, raw = min(options, key=lambda o: o[0])
    symbols, lengths = pairs_to_lengths(code) if extra_bits == 0 else range_to_lengths(code)
    offsets, bits = _encode_chunks(coded, symbols, lengths, chunk)
    if extra_bits:
        offsets = np.diff(np.append(offsets, len(bits) - PAD_BYTES)).astype(np.int16)
        raw = pack_fields(raw, 8 - extra_bits, PAD_BYTES)
    return CompressedTensor(
        dtype=dtype,
        shape=shape,
        chunk=chunk,
        code=torch.from_numpy(code),
        offsets=torch.from_numpy(offsets),
        bits=torch.from_numpy(bits),
        raw=torch.from_numpy(raw),
        extra_bits=extra_bits,
        words=len(words) if extra_bits else -1,
    )


def _option(
    words: np.ndarray, dtype: str, extra_bits: int, chunk: int
) -> tuple[float, int, np.ndarray, np.ndarray, np.ndarray] | None:
    """(estimated bytes, extra_bits, code, coded, raw) of a stream; None if it cannot be coded."""
    coded, raw = split_words(words, dtype, extra_bits)
    counts = np.bincount(coded, minlength=256 << extra_bits)
    if extra_bits and np.count_nonzero(counts) > MAX_SYMBOLS:
        return None
    lengths = code_lengths(counts)
    if extra_bits:
        code = range_code(lengths, counts)
    else:
        code = lengths_to_pairs(lengths, counts) if len(coded) else np.zeros(2, np.uint8)
    size = (
        float(np.dot(counts, lengths)) / 8
        # Per chunk: its offset, plus half a byte of padding on average.
        + -(-len(words) // chunk) * (4.5 if extra_bits == 0 else 2.5)
        + (field_bytes(len(words), 8 - extra_bits, PAD_BYTES) if extra_bits else len(words))
        + len(code)
    )
    return size, extra_bits, code, coded, raw


def _encode_chunks(
    coded: np.ndarray, symbols: np.ndarray, lengths: np.ndarray, chunk: int
) -> tuple[np.ndarray, np.ndarray]:
    """Huffman-code ``coded`` (n,) in byte-aligned chunks; returns (offsets (C,), bits (B,))."""
    n = len(coded)
    n_chunks = -(-n // chunk)
    length_of = np.zeros(int(symbols[-1]) + 1, dtype=np.int64)
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
    code_of = np.zeros(len(length_of), dtype=np.int64)
    code_of[symbols] = canonical_codes(symbols, lengths)
    codes = code_of[coded]
    # Codewords (<= 12 bits) never overlap, so OR-ing them into 32-bit words equals summing their
    # shifted values; bincount sums exactly in float64 since every partial sum is below 2**47.
    shifted = codes << (bit_pos & 31)
    word = bit_pos >> 5
    low = np.bincount(word, weights=shifted & 0xFFFFFFFF, minlength=n_words)
    high = np.bincount(word + 1, weights=shifted >> 32, minlength=n_words)
    words = (low[:n_words] + high[:n_words]).astype(np.uint32)
    bits = words.astype("<u4").view(np.uint8)[: starts[-1] + PAD_BYTES].copy()
    return starts[:-1].astype(np.int32), bits
