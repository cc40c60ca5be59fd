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

Every bit pattern (NaN payloads, infinities, subnormals, signed zeros) survives: the mapping is a
bijection on 16-bit words, the coder is lossless over all 256 byte values, and a palette holds
the exact words of its block.

Format 2 added palette mode. A plain tensor is stored exactly as in format 1, so format-1 files
are read unchanged; a format-1 reader rejects format-2 files by their version number.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from edgeinfer.kernels.compression.errors import CorruptDataError, UnsupportedFormatError
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

    @property
    def numel(self) -> int:
        return _prod(self.shape)

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
            (self.raw.numel(),),
            self.chunk,
            self.code,
            self.offsets,
            self.bits,
            self.raw,
        )

    def to(self, device: torch.device | str) -> CompressedTensor:
        moved = {k: v.to(device) for k, v in self.parts().items()}
        palette = None
        if self.palette is not None:
            counts, index = moved.pop("counts"), moved.pop("index")
            palette = Palette(self.palette.block, self.palette.width, counts, index)
        return CompressedTensor(self.dtype, self.shape, self.chunk, **moved, palette=palette)

    def _description(self) -> list[Any]:
        # A plain tensor is described as in format 1, so format-1 checksums still verify.
        head: list[Any] = [self.dtype, list(self.shape), self.chunk]
        if self.palette is not None:
            head += ["palette", self.palette.block, self.palette.width]
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
        tensor = cls(dtype, shape, chunk, **parts, palette=palette)
        if tensor.checksum() != crc:
            raise CorruptDataError(f"{where}: checksum mismatch, the compressed data is corrupted")
        tensor.validate(where)
        return tensor

    def validate(self, where: str) -> None:
        """Structural checks that keep a decoder's reads in bounds, even on crafted input."""
        m = self.raw.numel()
        chunks = -(-m // self.chunk) if self.chunk > 0 else -1
        offsets = self.offsets.cpu()
        ok = (
            self.chunk > 0
            and offsets.dtype == torch.int32
            and self.bits.dtype == self.raw.dtype == self.code.dtype == torch.uint8
            and offsets.numel() == chunks
            and self.bits.numel() >= PAD_BYTES
            and (chunks == 0 or int(offsets[0]) == 0)
            and bool(torch.all(offsets[1:] >= offsets[:-1]))
            and (chunks == 0 or int(offsets[-1]) <= self.bits.numel() - PAD_BYTES)
            and (m == self.numel if self.palette is None else self._palette_ok(m))
        )
        if not ok:
            raise CorruptDataError(f"{where}: inconsistent compressed tensor layout")

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
