"""The compressed tensor: its parts, how 16-bit words are split, and how it is checksummed.

A tensor is stored in one of two modes, chosen per tensor by the encoder from its data:

* plain: the tensor's ``n`` words form the *word stream* described below;
* palette: the word stream holds per-block palettes, and two more parts, ``counts`` and
  ``index``, say which palette word each element takes (see ``palette.py``).

The word stream of ``m`` 16-bit words is stored as four byte-oriented parts:

* ``code``    uint8 (2k,)   the Huffman code: ``[sym, length]`` pairs, see ``huffman.py``;
* ``offsets`` int32 (C,)    byte offset in ``bits`` where each chunk of ``chunk`` symbols starts
                            (chunks start byte-aligned; C = ceil(m / chunk));
* ``bits``    uint8 (B,)    the Huffman-coded bytes, LSB-first, then ``PAD_BYTES`` zero bytes so
                            that a decoder may always read a whole 8-byte window;
* ``raw``     uint8 (m,)    the bytes that are kept as they are.

Each 16-bit word is mapped to a (coded byte, raw byte) pair by a bijection chosen per dtype:

* bf16 (s eeeeeeee mmmmmmm): the word is rotated left by one bit, giving ``eeeeeeee mmmmmmms``.
  The coded byte is the 8-bit exponent and the raw byte holds mantissa and sign. Decoding is a
  byte interleave and a rotate right, with no bit-field surgery.
* fp16 (s eeeee mmmmmmmmmm): the coded byte is the high byte (sign, exponent, two mantissa bits),
  the raw byte the low byte. Coding the whole high byte is never worse than coding the 5-bit
  exponent alone and storing 11 raw bits: H(s, e, m2) <= H(e) + 3 bits, and a larger alphabet
  lowers Huffman's redundancy; it also keeps the raw part byte-aligned.

A word stream may be *extended* by ``extra_bits`` k (1 to ``MAX_EXTRA_BITS``): the coded symbol
is then the coded byte followed by the next k bits of the (rotated) word, i.e. for bf16 the
exponent and the top k mantissa bits, and the raw part keeps the low 8 - k bits. In trained
weights the top mantissa bits are skewed within each exponent's binade (the density falls with
the magnitude), so Huffman-coding them with the exponent saves ~0.1 bit per element. Such a
stream changes three parts: ``code`` uses the ``range`` layout (``huffman.py``), ``raw`` holds
(8 - k)-bit fields packed as in ``palette.pack_fields`` followed by ``PAD_BYTES`` zero bytes (so
a decoder may read 8 bytes at any field; random access), and
``offsets`` holds each chunk's size in bytes as int16 (decoders take the prefix sum), half the
bytes of int32 starts. Its length is stored as ``words``, since ``raw`` no longer gives it.

Every bit pattern (NaN payloads, infinities, subnormals, signed zeros) survives: the mapping is a
bijection on 16-bit words, the coder is lossless over all of its symbols, and a palette holds
the exact words of its block.

Format 2 added palette mode and extended streams. A plain tensor with ``extra_bits`` 0 is stored
exactly as in format 1, so format-1 files are read unchanged; a format-1 reader rejects format-2
files by their version number.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from edgeinfer.kernels.compression.errors import CorruptDataError, UnsupportedFormatError
from edgeinfer.kernels.compression.huffman import pairs_to_lengths, range_to_lengths
from edgeinfer.kernels.compression.palette import (
    COUNT_BITS,
    MAX_PALETTE,
    field_bytes,
    n_blocks,
    unpack_fields,
)

FORMAT_VERSION = 2
# Versions this code reads: format 1 is format 2 without palette mode.
READABLE_VERSIONS = (1, 2)
# Key of the safetensors header metadata that marks a compressed file and describes its tensors.
METADATA_KEY = "edgeinfer.compression"
# Stored part names are "<tensor name>" + PART_SEPARATOR + part.
PART_SEPARATOR = "::ei."
PARTS = ("code", "offsets", "bits", "raw")
PALETTE_PARTS = ("counts", "index")
PAD_BYTES = 8
# 1024 symbols per chunk: the int32 offset costs 0.03 bit per symbol, and a large tensor still
# gives tens of thousands of chunks for GPU threads or numpy lanes to decode side by side.
DEFAULT_CHUNK = 1024
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# Mantissa bits an extended stream may code with the exponent: past 3 the symbols no longer fill
# a contiguous range densely and the table bytes outgrow the gain.
MAX_EXTRA_BITS = 3


def stored_parts(entry: dict[str, Any]) -> tuple[str, ...]:
    """Names of the parts stored for a tensor, from its header metadata entry."""
    return PARTS + PALETTE_PARTS if entry.get("mode") == "palette" else PARTS


@dataclass(frozen=True)
class Palette:
    """The palette-mode parts of a tensor (see ``palette.py``); both are uint8 bit fields."""

    block: int
    width: int
    counts: torch.Tensor
    index: torch.Tensor


@dataclass(frozen=True)
class CompressedTensor:
    """One compressed bf16/fp16 tensor; the parts are uint8/int32 torch tensors (see module doc).

    The parts may live on any device: the CPU decoder needs them on the CPU, the Triton decoder on
    the GPU, which lets a model keep its weights compressed in GPU memory until they are used.
    """

    dtype: str
    shape: tuple[int, ...]
    chunk: int
    code: torch.Tensor
    offsets: torch.Tensor
    bits: torch.Tensor
    raw: torch.Tensor
    palette: Palette | None = None
    extra_bits: int = 0
    # Word-stream length; stored only for extended streams (otherwise ``raw.numel()``).
    words: int = -1

    @property
    def numel(self) -> int:
        return _prod(self.shape)

    @property
    def stream_words(self) -> int:
        """Number of words in the word stream (``numel`` in plain mode)."""
        return self.raw.numel() if self.extra_bits == 0 else self.words

    @property
    def raw_bits(self) -> int:
        """Width of each element's raw field."""
        return 8 - self.extra_bits

    def code_lengths(self) -> tuple[np.ndarray, np.ndarray]:
        """The stream's validated Huffman code: (symbols, lengths), int64 (see ``huffman.py``)."""
        code = self.code.cpu().numpy()
        return pairs_to_lengths(code) if self.extra_bits == 0 else range_to_lengths(code)

    def chunk_starts(self) -> torch.Tensor:
        """Byte offset of each chunk in ``bits``, int64, on the parts' device."""
        if self.extra_bits == 0:
            return self.offsets.to(torch.int64)
        sizes = self.offsets.to(torch.int64)
        return torch.cumsum(sizes, 0) - sizes

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        """Stored size of the parts in bytes (the header metadata is a few dozen bytes more)."""
        return sum(p.numel() * p.element_size() for p in self.parts().values())

    def parts(self) -> dict[str, torch.Tensor]:
        parts = {"code": self.code, "offsets": self.offsets, "bits": self.bits, "raw": self.raw}
        if self.palette is not None:
            parts.update(counts=self.palette.counts, index=self.palette.index)
        return parts

    def stream(self) -> CompressedTensor:
        """The word stream alone, as a plain tensor: the tensor itself in plain mode."""
        if self.palette is None:
            return self
        return CompressedTensor(
            self.dtype,
            (self.stream_words,),
            self.chunk,
            self.code,
            self.offsets,
            self.bits,
            self.raw,
            extra_bits=self.extra_bits,
            words=self.words,
        )

    def to(self, device: torch.device | str) -> CompressedTensor:
        parts, target = self.parts(), torch.device(device)
        if all(p.device == target for p in parts.values()):
            return self  # decoders call this on every tensor: skip rebuilding it
        moved = {k: v.to(device) for k, v in parts.items()}
        palette = None
        if self.palette is not None:
            counts, index = moved.pop("counts"), moved.pop("index")
            palette = Palette(self.palette.block, self.palette.width, counts, index)
        return CompressedTensor(
            self.dtype,
            self.shape,
            self.chunk,
            **moved,
            palette=palette,
            extra_bits=self.extra_bits,
            words=self.words,
        )

    def _description(self) -> list[Any]:
        # A plain tensor is described as in format 1, so format-1 checksums still verify.
        head: list[Any] = [self.dtype, list(self.shape), self.chunk]
        if self.palette is not None:
            head += ["palette", self.palette.block, self.palette.width]
        if self.extra_bits:
            head += ["extended", self.extra_bits, self.words]
        return head

    def checksum(self) -> int:
        """CRC-32 of the description and of every part (zlib's runs at several GB/s)."""
        crc = zlib.crc32(json.dumps(self._description()).encode())
        for part in self.parts().values():
            crc = zlib.crc32(part.detach().cpu().contiguous().view(torch.uint8).numpy().data, crc)
        return crc

    def describe(self) -> dict[str, Any]:
        """The JSON-able entry stored for this tensor in the file's header metadata."""
        entry: dict[str, Any] = {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "chunk": self.chunk,
            "crc32": self.checksum(),
        }
        if self.palette is not None:
            entry.update(mode="palette", block=self.palette.block, width=self.palette.width)
        if self.extra_bits:
            entry.update(extra_bits=self.extra_bits, words=self.words)
        return entry

    @classmethod
    def from_parts(
        cls, entry: dict[str, Any], parts: dict[str, torch.Tensor], where: str
    ) -> CompressedTensor:
        """Rebuild a stored tensor and verify it; ``where`` names it in error messages."""
        try:
            dtype, shape, chunk, crc = (
                str(entry["dtype"]),
                tuple(int(d) for d in entry["shape"]),
                int(entry["chunk"]),
                int(entry["crc32"]),
            )
            mode = entry.get("mode", "plain")
            extra_bits = int(entry.get("extra_bits", 0))
            words = int(entry["words"]) if extra_bits else -1
            palette = None
            if mode == "palette":
                block, width = int(entry["block"]), int(entry["width"])
                palette = Palette(block, width, parts.pop("counts"), parts.pop("index"))
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptDataError(f"{where}: malformed compression metadata ({exc})") from exc
        if dtype not in DTYPES:
            raise UnsupportedFormatError(f"{where}: unsupported compressed dtype {dtype!r}")
        if mode not in ("plain", "palette"):
            raise UnsupportedFormatError(f"{where}: unknown compression mode {mode!r}")
        if not 0 <= extra_bits <= MAX_EXTRA_BITS:
            raise UnsupportedFormatError(f"{where}: unsupported extra_bits {extra_bits}")
        tensor = cls(
            dtype, shape, chunk, **parts, palette=palette, extra_bits=extra_bits, words=words
        )
        if tensor.checksum() != crc:
            raise CorruptDataError(f"{where}: checksum mismatch, the compressed data is corrupted")
        tensor.validate(where)
        return tensor

    def validate(self, where: str) -> None:
        """Structural checks that keep a decoder's reads in bounds, even on crafted input."""
        m = self.stream_words
        chunks = -(-m // self.chunk) if self.chunk > 0 and m >= 0 else -1
        ok = (
            self.chunk > 0
            and self.bits.dtype == self.raw.dtype == self.code.dtype == torch.uint8
            and self.offsets.numel() == chunks
            and self.bits.numel() >= PAD_BYTES
            and self._stream_ok(m)
            and (m == self.numel if self.palette is None else self._palette_ok(m))
        )
        if not ok:
            raise CorruptDataError(f"{where}: inconsistent compressed tensor layout")

    def _stream_ok(self, m: int) -> bool:
        """Chunk offsets in order and inside ``bits``; raw fields of the right size."""
        offsets = self.offsets.cpu()
        if self.extra_bits == 0:
            return (
                offsets.dtype == torch.int32
                and (m == 0 or int(offsets[0]) == 0)
                and bool(torch.all(offsets[1:] >= offsets[:-1]))
                and (m == 0 or int(offsets[-1]) <= self.bits.numel() - PAD_BYTES)
            )
        return (
            offsets.dtype == torch.int16
            and bool(torch.all(offsets >= 0))
            and int(offsets.to(torch.int64).sum()) <= self.bits.numel() - PAD_BYTES
            and self.raw.numel() == field_bytes(m, self.raw_bits, PAD_BYTES)
        )

    def _palette_ok(self, stream_words: int) -> bool:
        """The palette fields have their exact sizes and the block sizes sum to the stream."""
        palette = self.palette
        max_width = (MAX_PALETTE - 1).bit_length()
        if palette is None or palette.block <= 0 or not 0 <= palette.width <= max_width:
            return False
        blocks = n_blocks(self.numel, palette.block)
        counts = palette.counts.cpu()
        if not (
            counts.dtype == palette.index.dtype == torch.uint8
            and counts.numel() == field_bytes(blocks, COUNT_BITS)
            and palette.index.numel() == field_bytes(self.numel, palette.width)
        ):
            return False
        sizes = unpack_fields(counts.numpy(), COUNT_BITS, blocks) + 1
        return int(sizes.sum()) == stream_words and (self.numel > 0 or stream_words == 0)


def _prod(shape: tuple[int, ...]) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total
