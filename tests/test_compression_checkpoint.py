"""Compressed checkpoint directories: round trip, pass-through files, corruption detection."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from edgeinfer.kernels.compression.checkpoint import compress_dir, decompress_dir, tensor_class
from edgeinfer.kernels.compression.encoder import compress_tensor
from edgeinfer.kernels.compression.errors import (
    CompressionError,
    CorruptDataError,
    UnsupportedFormatError,
)
from edgeinfer.kernels.compression.format import METADATA_KEY, CompressedTensor, Palette
from edgeinfer.kernels.compression.reader import (
    CompressedSafetensorsReader,
    decompress,
    is_compressed_checkpoint,
)


def _tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "model.layers.0.self_attn.q_proj.weight": (torch.randn(64, 64) * 0.02).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": (torch.randn(96, 64) * 0.02).to(torch.bfloat16),
        "model.layers.0.input_layernorm.weight": torch.ones(64, dtype=torch.bfloat16),
        "model.embed_tokens.weight": (torch.randn(100, 64) * 0.02).to(torch.float16),
        "rope.inv_freq": torch.rand(32),  # float32: stored as is
        "position_ids": torch.arange(7),
        # Dequantized from 4-bit groups of 32: palette mode.
        "model.layers.0.mlp.down_proj.weight": (
            torch.randint(0, 16, (64, 2, 32)) * torch.rand(64, 2, 1) * 0.01
        )
        .reshape(64, 64)
        .to(torch.bfloat16),
    }


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    src = tmp_path / "in"
    (src / "sub").mkdir(parents=True)
    tensors = _tensors()
    names = list(tensors)
    save_file({k: tensors[k] for k in names[:3]}, src / "model-1.safetensors", {"format": "pt"})
    save_file({k: tensors[k] for k in names[3:]}, src / "sub" / "model-2.safetensors")
    (src / "config.json").write_text(json.dumps({"hidden_size": 64}))
    (src / "sub" / "tokenizer.txt").write_bytes(b"\x00\x01 not a tensor")
    return src


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
    )


def test_directory_roundtrip_is_bit_exact(checkpoint: Path, tmp_path: Path) -> None:
    reports = compress_dir(checkpoint, tmp_path / "c")
    assert is_compressed_checkpoint(tmp_path / "c") and not is_compressed_checkpoint(checkpoint)
    assert (tmp_path / "c" / "sub" / "tokenizer.txt").read_bytes() == b"\x00\x01 not a tensor"
    assert json.loads((tmp_path / "c" / "config.json").read_text()) == {"hidden_size": 64}
    by_name = {r.name: r for r in reports}
    assert by_name["rope.inv_freq"].bytes_after == by_name["rope.inv_freq"].bytes_before
    assert by_name["model.layers.0.mlp.up_proj.weight"].bytes_after < 0.75 * 96 * 64 * 2
    decompress_dir(tmp_path / "c", tmp_path / "d")
    restored = {
        **load_file(tmp_path / "d" / "model-1.safetensors"),
        **load_file(tmp_path / "d" / "sub" / "model-2.safetensors"),
    }
    original = _tensors()
    assert restored.keys() == original.keys()
    assert all(_same(restored[k], original[k]) for k in original)
    with safe_open(str(tmp_path / "d" / "model-1.safetensors"), "pt") as handle:
        assert handle.metadata() == {"format": "pt"}


def test_float32_tensors_are_stored_untouched(checkpoint: Path, tmp_path: Path) -> None:
    compress_dir(checkpoint, tmp_path / "c")
    stored = load_file(tmp_path / "c" / "sub" / "model-2.safetensors")
    assert _same(stored["rope.inv_freq"], _tensors()["rope.inv_freq"])
    assert "model.embed_tokens.weight" not in stored  # kept only as compressed parts


def test_reader_yields_original_tensors(checkpoint: Path, tmp_path: Path) -> None:
    compress_dir(checkpoint, tmp_path / "c")
    original = _tensors()
    with CompressedSafetensorsReader(tmp_path / "c") as reader:
        assert reader.names() == sorted(list(original)[:3])  # only the top-level file
        got = dict(reader)
        packed = reader.get_compressed("model.layers.0.mlp.up_proj.weight")
        assert (
            packed is not None
            and reader.get_compressed("model.layers.0.input_layernorm.weight") is not None
        )
        assert _same(decompress(packed), original["model.layers.0.mlp.up_proj.weight"])
    assert all(_same(got[k], original[k]) for k in got)
    with CompressedSafetensorsReader(tmp_path / "c" / "sub" / "model-2.safetensors") as reader:
        assert reader.get_compressed("rope.inv_freq") is None
        assert _same(reader.get("model.embed_tokens.weight"), original["model.embed_tokens.weight"])


def _flip_byte(path: Path, offset_from_end: int) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("offset_from_end", [1, 500, 3000])
def test_corrupted_data_is_detected(checkpoint: Path, tmp_path: Path, offset_from_end: int) -> None:
    compress_dir(checkpoint, tmp_path / "c")
    _flip_byte(tmp_path / "c" / "model-1.safetensors", offset_from_end)
    with pytest.raises(CorruptDataError, match="checksum mismatch"):
        decompress_dir(tmp_path / "c", tmp_path / "d")


def test_truncated_file_is_detected(checkpoint: Path, tmp_path: Path) -> None:
    compress_dir(checkpoint, tmp_path / "c")
    path = tmp_path / "c" / "model-1.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CorruptDataError, match=r"model-1\.safetensors"):
        CompressedSafetensorsReader(path)


def test_compressing_twice_is_refused(checkpoint: Path, tmp_path: Path) -> None:
    compress_dir(checkpoint, tmp_path / "c")
    with pytest.raises(CompressionError, match="already compressed"):
        compress_dir(tmp_path / "c", tmp_path / "cc")


@pytest.mark.parametrize(
    ("name", "label"),
    [
        ("model.layers.3.self_attn.k_proj.weight", "attention"),
        ("encoder.layer.0.attention.output.dense.weight", "attention"),
        ("encoder.layer.0.attention.output.LayerNorm.weight", "norm"),
        ("encoder.layer.0.output.dense.weight", "mlp"),
        ("model.layers.3.mlp.down_proj.weight", "mlp"),
        ("model.embed_tokens.weight", "embedding"),
        ("model.norm.weight", "norm"),
        ("pooler.dense.bias", "other"),
    ],
)
def test_tensor_classes(name: str, label: str) -> None:
    assert tensor_class(name) == label


def _rewrite_header(
    path: Path, edit: Callable[[dict[str, Any], dict[str, torch.Tensor]], None]
) -> None:
    """Re-save ``path`` after ``edit(header, tensors)`` changed its compression header."""
    tensors = load_file(path)
    with safe_open(str(path), "pt") as handle:
        metadata = dict(handle.metadata())
    header = json.loads(metadata[METADATA_KEY])
    edit(header, tensors)
    metadata[METADATA_KEY] = json.dumps(header)
    save_file(tensors, path, metadata=metadata)


def test_palette_tensor_is_stored_with_its_fields(checkpoint: Path, tmp_path: Path) -> None:
    compress_dir(checkpoint, tmp_path / "c")
    name = "model.layers.0.mlp.down_proj.weight"
    with CompressedSafetensorsReader(tmp_path / "c" / "sub") as reader:
        packed = reader.get_compressed(name)
        assert packed is not None and packed.palette is not None
        assert reader.stored_nbytes(name) == packed.nbytes < 0.6 * 64 * 64 * 2
        assert _same(reader.get(name), _tensors()[name])


def test_format_1_files_still_read(tmp_path: Path) -> None:
    # Format 1 had plain mode with 0 extra bits only, which format 2 stores byte for byte the
    # same way: such tensors, under a version-1 header, are format-1 files.
    original = {"w": (torch.randn(40, 64) * 0.02).to(torch.bfloat16), "b": torch.randn(9).half()}
    stored: dict[str, torch.Tensor] = {}
    entries: dict[str, Any] = {}
    for name, tensor in original.items():
        packed = compress_tensor(tensor, extra_bits=0)
        assert packed.palette is None
        entries[name] = packed.describe()
        stored.update({f"{name}::ei.{p}": v for p, v in packed.parts().items()})
    assert set(entries["w"]) == {"dtype", "shape", "chunk", "crc32"}  # format 1's keys
    path = tmp_path / "model.safetensors"
    header = json.dumps({"version": 1, "tensors": entries})
    save_file(stored, path, metadata={METADATA_KEY: header})
    with CompressedSafetensorsReader(path) as reader:
        packed_back = [reader.get_compressed(name) for name in original]
        assert all(p is not None and p.extra_bits == 0 for p in packed_back)
        assert all(_same(reader.get(name), t) for name, t in original.items())


def test_unknown_format_version_is_a_clear_error(checkpoint: Path, tmp_path: Path) -> None:
    compress_dir(checkpoint, tmp_path / "c")
    path = tmp_path / "c" / "model-1.safetensors"
    _rewrite_header(path, lambda header, _: header.update(version=3))
    with pytest.raises(UnsupportedFormatError, match="format version 3 is not supported"):
        CompressedSafetensorsReader(path)


def test_crafted_palette_fields_are_refused(checkpoint: Path, tmp_path: Path) -> None:
    # A consistent checksum over inconsistent parts: refused before any decoder reads them.
    compress_dir(checkpoint, tmp_path / "c")
    path = tmp_path / "c" / "sub" / "model-2.safetensors"
    name = "model.layers.0.mlp.down_proj.weight"

    def shrink_index(header: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        tensors[f"{name}::ei.index"] = tensors[f"{name}::ei.index"][:-3].clone()
        entry = header["tensors"][name]
        parts = {p: tensors[f"{name}::ei.{p}"] for p in ("code", "offsets", "bits", "raw")}
        fields = Palette(
            entry["block"],
            entry["width"],
            *(tensors[f"{name}::ei.{p}"] for p in ("counts", "index")),
        )
        crafted = CompressedTensor(
            entry["dtype"],
            tuple(entry["shape"]),
            entry["chunk"],
            **parts,
            palette=fields,
            extra_bits=entry.get("extra_bits", 0),
            words=entry.get("words", -1),
        )
        entry["crc32"] = crafted.checksum()

    _rewrite_header(path, shrink_index)
    with (
        CompressedSafetensorsReader(path) as reader,
        pytest.raises(CorruptDataError, match="inconsistent compressed tensor layout"),
    ):
        reader.get(name)


@pytest.mark.parametrize("damage", ["negative_size", "short_raw", "words"])
def test_crafted_extended_streams_are_refused(tmp_path: Path, damage: str) -> None:
    # Checksummed but inconsistent: chunk sizes past the stream, raw fields cut short, or a
    # stream length that does not match the tensor.
    packed = compress_tensor((torch.randn(3000) * 0.02).to(torch.bfloat16), 64, extra_bits=2)
    parts = packed.parts()
    words = packed.words
    if damage == "negative_size":
        parts["offsets"] = parts["offsets"].clone()
        parts["offsets"][3] = -8
    elif damage == "short_raw":
        parts["raw"] = parts["raw"][:-1].clone()
    else:
        words += 1
    crafted = CompressedTensor(
        packed.dtype, packed.shape, packed.chunk, **parts, extra_bits=2, words=words
    )
    entry = crafted.describe()
    with pytest.raises(CorruptDataError, match="inconsistent compressed tensor layout"):
        CompressedTensor.from_parts(entry, dict(parts), "t")
