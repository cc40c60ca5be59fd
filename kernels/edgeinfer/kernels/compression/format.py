"""The compressed tensor: its parts, how 16-bit words are split, and how it is checksummed.

A bf16 or fp16 tensor of ``n`` elements is stored as four byte-oriented parts:

* ``code``    uint8 (2k,)   the Huffman code: ``[sym, length]`` pairs, see ``huffman.py``;
* ``offsets`` int32 (C,)    byte offset in ``bits`` where each chunk of ``chunk`` symbols starts
                            (chunks start byte-aligned; C = ceil(n / chunk));
* ``bits``    uint8 (B,)    the Huffman-coded bytes, LSB-first, then ``PAD_BYTES`` zero bytes so
                            that a decoder may always read a whole 8-byte window;
* ``raw``     uint8 (n,)    the bytes that are kept as they are.

Each 16-bit word is mapped to a (coded byte, raw byte) pair by a bijection chosen per dtype:

* bf16 (s eeeeeeee mmmmmmm): the word is rotated left by one bit, giving ``eeeeeeee mmmmmmms``.
  The coded byte is the 8-bit exponent and the raw byte holds mantissa and sign. Decoding is a
  byte interleave and a rotate right, with no bit-field surgery.
* fp16 (s eeeee mmmmmmmmmm): the coded byte is the high byte (sign, exponent, two mantissa bits),
  the raw byte the low byte. Coding the whole high byte is never worse than coding the 5-bit
  exponent alone and storing 11 raw bits: H(s, e, m2) <= H(e) + 3 bits, and a larger alphabet
  lowers Huffman's redundancy; it also keeps the raw part byte-aligned.

Every bit pattern (NaN payloads, infinities, subnormals, signed zeros) survives: the mapping is a
bijection on 16-bit words and the coder is lossless over all 256 byte values.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from edgeinfer.kernels.compression.errors import CorruptDataError, UnsupportedFormatError

FORMAT_VERSION = 1
# Key of the safetensors header metadata that marks a compressed file and describes its tensors.
METADATA_KEY = "edgeinfer.compression"
# Stored part names are "<tensor name>" + PART_SEPARATOR + part.
PART_SEPARATOR = "::ei."
PARTS = ("code", "offsets", "bits", "raw")
PAD_BYTES = 8
# 1024 symbols per chunk: the int32 offset costs 0.03 bit per symbol, and a large tensor still
# gives tens of thousands of chunks for GPU threads or numpy lanes to decode side by side.
DEFAULT_CHUNK = 1024
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


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

    @property
    def numel(self) -> int:
        return self.raw.numel()

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        """Stored size of the parts in bytes (the header metadata is a few dozen bytes more)."""
        return sum(p.numel() * p.element_size() for p in self.parts().values())

    def parts(self) -> dict[str, torch.Tensor]:
        return {"code": self.code, "offsets": self.offsets, "bits": self.bits, "raw": self.raw}

    def to(self, device: torch.device | str) -> CompressedTensor:
        moved = {k: v.to(device) for k, v in self.parts().items()}
        return CompressedTensor(self.dtype, self.shape, self.chunk, **moved)

    def checksum(self) -> int:
        """CRC-32 of the description and of every part (zlib's runs at several GB/s)."""
        crc = zlib.crc32(json.dumps([self.dtype, list(self.shape), self.chunk]).encode())
        for part in self.parts().values():
            crc = zlib.crc32(part.detach().cpu().contiguous().view(torch.uint8).numpy().data, crc)
        return crc

    def describe(self) -> dict[str, Any]:
        """The JSON-able entry stored for this tensor in the file's header metadata."""
        return {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "chunk": self.chunk,
            "crc32": self.checksum(),
        }

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
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptDataError(f"{where}: malformed compression metadata ({exc})") from exc
        if dtype not in DTYPES:
            raise UnsupportedFormatError(f"{where}: unsupported compressed dtype {dtype!r}")
        tensor = cls(dtype, shape, chunk, **parts)
        if tensor.checksum() != crc:
            raise CorruptDataError(f"{where}: checksum mismatch, the compressed data is corrupted")
        tensor.validate(where)
        return tensor

    def validate(self, where: str) -> None:
        """Structural checks that keep a decoder's reads in bounds, even on crafted input."""
        n = self.numel
        chunks = -(-n // self.chunk) if self.chunk > 0 else -1
        offsets = self.offsets.cpu()
        ok = (
            self.chunk > 0
            and n == _prod(self.shape)
            and offsets.dtype == torch.int32
            and self.bits.dtype == self.raw.dtype == self.code.dtype == torch.uint8
            and offsets.numel() == chunks
            and self.bits.numel() >= PAD_BYTES
            and (chunks == 0 or int(offsets[0]) == 0)
            and bool(torch.all(offsets[1:] >= offsets[:-1]))
            and (chunks == 0 or int(offsets[-1]) <= self.bits.numel() - PAD_BYTES)
        )
        if not ok:
            raise CorruptDataError(f"{where}: inconsistent compressed tensor layout")


def _prod(shape: tuple[int, ...]) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total
