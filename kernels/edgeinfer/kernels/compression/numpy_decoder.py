"""Vectorised numpy decoder: the fallback when numba (``numba_decoder.py``) is not installed.

Every chunk of a batch of word streams is decoded in lock-step.

Lane ``c`` decodes one chunk. Each step of the loop decodes exactly ``GROUP`` (4) symbols in every
lane with about a dozen numpy calls over arrays of lanes: peek up to 16 bits at the lane's bit
position, look them up in a table that decodes up to four whole codewords at once, store the four
symbol bytes, advance. Four codewords fit in 16 bits ~96% of the time on trained bf16 exponents
(~2.7 bits each); the lanes where they do not take one more lookup on that small subset. As every
lane yields the same number of symbols per step, the output needs no compaction and the loop runs
a known number of steps. Many tensors share one loop (each lane looks up its own tensor's table),
so small tensors do not pay the per-step overhead alone. The lanes decode each symbol's rank in
its code (at most 256 symbols, so a byte); ``_assemble`` maps ranks to symbols, which differ
only in extended streams (exponent plus mantissa bits, up to 11 bits).
"""

from __future__ import annotations

import numpy as np

from edgeinfer.kernels.compression.format import CompressedTensor
from edgeinfer.kernels.compression.huffman import LENGTH_SHIFT, decode_table
from edgeinfer.kernels.compression.palette import COUNT_BITS, gather, n_blocks, unpack_fields

GROUP = 4
MAX_PEEK_BITS = 16
# Lanes are decoded in blocks of this many so that their working set (bit-stream cache lines,
# lane state) stays in a core's L2 cache; large enough to amortise numpy's per-call overhead.
BLOCK_LANES = 16384
_U64 = np.uint64
# Table entry (uint64): bits 0-31 the symbols decoded from the window, first symbol in the low
# byte, unused bytes zero; for k = 1..4 a 5-bit field at 32 + 5 (k - 1) holding the bits used by the
# first min(k, count) symbols; bits 62-63 hold GROUP - count, so "short" is entry >= 2**62.
_CUM_SHIFT = 32
_USED_SHIFT = _CUM_SHIFT + 5 * (GROUP - 1)
_MISSING_SHIFT = 62


def group_table(lengths: np.ndarray, peek_bits: int) -> np.ndarray:
    """Table over every ``peek_bits``-bit window (uint64, shape (2**peek_bits,)); layout above.

    ``lengths`` are the code lengths of the code's symbols in order; the table holds their ranks.
    """
    ranks, max_len = decode_table(np.arange(len(lengths)), lengths)
    # Re-packed as rank | length << 8; the low bits of the window decide.
    single = (ranks & 0xFF) | ((ranks >> LENGTH_SHIFT) << 8)
    single = np.tile(single, 1 << (peek_bits - max_len)).astype(_U64)
    mask = _U64((1 << peek_bits) - 1)
    window = np.arange(1 << peek_bits, dtype=_U64)
    entry = np.zeros_like(window)
    used = np.zeros_like(window)
    count = np.zeros_like(window)
    for k in range(GROUP):
        hit = single[(window >> used) & mask]
        length = hit >> _U64(8)
        # Only codewords lying wholly inside the window are decoded from it.
        fits = (used + length <= peek_bits).astype(_U64) * (count == k)
        entry |= ((hit & _U64(0xFF)) * fits) << _U64(8 * k)
        used += length * fits
        count += fits
        entry |= used << _U64(_CUM_SHIFT + 5 * k)
    return entry | ((GROUP - count) << _U64(_MISSING_SHIFT))


def peek_bits_for(tensor: CompressedTensor) -> int:
    """Window width: up to 16 bits, with a table of at most ~numel / 64 entries.

    Building the table costs about as much per entry as decoding costs per symbol, and a small
    table also stays in cache; a narrower window only sends more lanes to ``_complete``.
    """
    max_len = int(tensor.code_lengths()[1].max())
    return max(max_len, min(MAX_PEEK_BITS, tensor.numel.bit_length() - 7))


def decode_words_numpy(tensors: list[CompressedTensor]) -> list[np.ndarray]:
    """The flat uint16 words of CPU-resident tensors, in input order.

    All word streams are decoded in shared lock-step loops (one per chunk size); palette-mode
    tensors then look their words up in their decoded palettes.
    """
    streams = [t.stream() for t in tensors]
    decoded: dict[int, np.ndarray] = {}
    for chunk in sorted({t.chunk for t in streams}):
        batch = [i for i, t in enumerate(streams) if t.chunk == chunk]
        outs = _decode_batch([streams[i] for i in batch], chunk)
        decoded.update(zip(batch, outs, strict=True))
    return [_apply_palette(t, decoded[i]) for i, t in enumerate(tensors)]


def _apply_palette(tensor: CompressedTensor, words: np.ndarray) -> np.ndarray:
    fields = tensor.palette
    if fields is None:
        return words
    blocks = n_blocks(tensor.numel, fields.block)
    counts = unpack_fields(fields.counts.numpy(), COUNT_BITS, blocks)
    index = unpack_fields(fields.index.numpy(), fields.width, tensor.numel)
    return gather(words, counts, index, fields.block, tensor.numel)


def _decode_batch(tensors: list[CompressedTensor], chunk: int) -> list[np.ndarray]:
    steps = -(-chunk // GROUP)
    lanes_of = [t.offsets.numel() for t in tensors]
    # All bit streams in one uint32 word array, each starting on a word boundary.
    streams = [t.bits.numpy() for t in tensors]
    word_base = np.cumsum([0] + [-(-len(s) // 4) for s in streams])
    words = np.zeros(int(word_base[-1]) + 1, dtype=np.uint32)
    byte_view = words.view(np.uint8)
    for stream, base in zip(streams, word_base[:-1], strict=True):
        byte_view[base * 4 : base * 4 + len(stream)] = stream
    # pairs[i] = words[i] | words[i + 1] << 32: any 16-bit window at bit p is in pairs[p >> 5].
    pairs = words[:-1].astype(_U64) | (words[1:].astype(_U64) << _U64(32))
    codes = [t.code_lengths() for t in tensors]
    peek = [peek_bits_for(t) for t in tensors]
    tables = [group_table(lengths, bits) for (_, lengths), bits in zip(codes, peek, strict=True)]
    table_start = np.cumsum([0] + [len(t) for t in tables])[:-1].astype(_U64)
    lane_state = {
        "pos": np.concatenate(
            [np.zeros(0, _U64)]
            + [
                t.chunk_starts().numpy().astype(_U64) * _U64(8) + _U64(b * 32)
                for t, b in zip(tensors, word_base[:-1], strict=True)
            ]
        ),
        "base": np.repeat(table_start, lanes_of),
        "mask": np.repeat(np.array([(1 << b) - 1 for b in peek], dtype=_U64), lanes_of),
    }
    table = np.concatenate(tables)
    n_lanes = sum(lanes_of)
    # rows[c] = the decoded symbols of lane c: GROUP bytes per step, in order.
    rows = np.empty((n_lanes, steps * GROUP), dtype=np.uint8)
    for start in range(0, n_lanes, BLOCK_LANES):
        block = slice(start, min(start + BLOCK_LANES, n_lanes))
        state = {k: v[block].copy() for k, v in lane_state.items()}
        dense = _lockstep(pairs, table, state, steps)
        rows[block].view(np.uint32)[:] = dense.T
    outputs = []
    first_lane = 0
    for tensor, lanes, (symbols, _) in zip(tensors, lanes_of, codes, strict=True):
        outputs.append(_assemble(tensor, symbols, rows[first_lane : first_lane + lanes, :chunk]))
        first_lane += lanes
    return outputs


def _window(pairs: np.ndarray, pos: np.ndarray, mask: np.ndarray, out: np.ndarray) -> np.ndarray:
    """The next ``mask`` bits at bit positions ``pos`` (uint64, one per lane)."""
    np.take(pairs, pos >> _U64(5), out=out, mode="clip")  # clip: lanes past the end read junk
    np.right_shift(out, pos & _U64(31), out=out)
    return np.bitwise_and(out, mask, out=out)


def _lockstep(
    pairs: np.ndarray, table: np.ndarray, state: dict[str, np.ndarray], steps: int
) -> np.ndarray:
    """Run the decode loop on one block of lanes; returns uint32 (steps, lanes) of symbols."""
    pos, base, mask = state["pos"], state["base"], state["mask"]
    n_lanes = len(pos)
    dense = np.empty((steps, n_lanes), dtype=np.uint32)
    window, entry, tmp = (np.empty(n_lanes, dtype=_U64) for _ in range(3))
    short = np.empty(n_lanes, dtype=bool)
    for step in range(steps):
        _window(pairs, pos, mask, window)
        window += base
        np.take(table, window, out=entry, mode="clip")
        np.copyto(dense[step], entry, casting="unsafe")  # keeps the low 32 bits: the symbols
        np.right_shift(entry, _U64(_USED_SHIFT), out=tmp)
        np.bitwise_and(tmp, _U64(31), out=tmp)
        pos += tmp
        np.greater_equal(entry, _U64(1 << _MISSING_SHIFT), out=short)
        lanes = np.flatnonzero(short)
        if lanes.size:
            dense[step, lanes] = _complete(pairs, table, state, entry[lanes], lanes)
    return dense


def _complete(
    pairs: np.ndarray,
    table: np.ndarray,
    state: dict[str, np.ndarray],
    held: np.ndarray,
    lanes: np.ndarray,
) -> np.ndarray:
    """Finish ``lanes`` whose window held fewer than GROUP codewords; advances their position.

    ``held`` are their table entries (already consumed). One more window almost always supplies
    the missing symbols; the rare lanes it does not (three or more long codewords) loop again.
    Returns their GROUP symbol bytes (uint32).
    """
    symbols = held & _U64(0xFFFFFFFF)
    missing = held >> _U64(_MISSING_SHIFT)
    pos, base, mask = state["pos"][lanes], state["base"][lanes], state["mask"][lanes]
    todo = np.arange(len(lanes))
    while True:
        miss = missing[todo]
        entry = table.take(
            _window(pairs, pos[todo], mask[todo], np.empty(len(miss), _U64)) + base[todo]
        )
        # The new symbols go after the ones held; any beyond GROUP are shifted out of 32 bits.
        symbols[todo] |= (entry << (_U64(8 * GROUP) - _U64(8) * miss)) & _U64(0xFFFFFFFF)
        pos[todo] += (entry >> (_U64(_CUM_SHIFT - 5) + _U64(5) * miss)) & _U64(31)
        missing[todo] = miss - np.minimum(miss, _U64(GROUP) - (entry >> _U64(_MISSING_SHIFT)))
        todo = np.flatnonzero(missing)
        if not todo.size:
            break
    state["pos"][lanes] = pos
    return symbols.astype(np.uint32)


def _assemble(tensor: CompressedTensor, symbols: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Join rank rows (C, chunk) and the raw fields into the original 16-bit words (flat)."""
    n = tensor.stream_words
    ranks = rows.reshape(-1)[:n]
    # Word = symbol << raw_bits | raw field.
    words = symbols.astype(np.uint16)[ranks]
    words <<= np.uint16(tensor.raw_bits)
    raw = tensor.raw.numpy()
    if tensor.extra_bits:
        raw = unpack_fields(raw, tensor.raw_bits, n).astype(np.uint16)
    words |= raw
    if tensor.dtype == "bfloat16":
        # Undo the encoder's rotate-left: eeeeeeee mmmmmmms -> s eeeeeeee mmmmmmm.
        high = words << np.uint16(15)
        words >>= np.uint16(1)
        words |= high
    return words
