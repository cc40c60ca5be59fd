"""``edgectl compress`` / ``decompress`` through click's CliRunner, with exact output."""

from __future__ import annotations

from pathlib import Path

import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from edgeinfer.ctl.main import cli


def _checkpoint(root: Path) -> dict[str, torch.Tensor]:
    root.mkdir()
    tensors = {
        "layers.0.attn.q_proj.weight": torch.full((4, 8), 0.25, dtype=torch.bfloat16),
        "layers.0.mlp.up_proj.weight": torch.full((8, 8), -1.0, dtype=torch.bfloat16),
        "norm.weight": torch.ones(8, dtype=torch.bfloat16),
        "scale": torch.ones(2),
    }
    save_file(tensors, root / "model.safetensors")
    return tensors


def test_compress_prints_a_summary_per_class(tmp_path: Path) -> None:
    _checkpoint(tmp_path / "in")
    result = CliRunner().invoke(cli, ["compress", str(tmp_path / "in"), str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    # All-equal tensors take palette mode: one palette word (1 raw byte; its exponent costs 0 bits)
    # plus 14 bytes of code table, chunk offset and read padding, and 5 bytes of palette fields
    # (the index is 0 bits wide): 20 bytes whatever the size, more than an 8-element norm.
    assert result.output.splitlines() == [
        f"compressed {tmp_path / 'in'} into {tmp_path / 'out'}",
        "┏━━━━━━━━━━━┳━━━━━━━━━┳━━━━━━━━┳━━━━━━━┳━━━━━━━━┓",
        "┃ class     ┃ tensors ┃ before ┃ after ┃  ratio ┃",
        "┡━━━━━━━━━━━╇━━━━━━━━━╇━━━━━━━━╇━━━━━━━╇━━━━━━━━┩",
        "│ attention │       1 │     64 │    20 │  31.2% │",
        "│ mlp       │       1 │    128 │    20 │  15.6% │",
        "│ norm      │       1 │     16 │    20 │ 125.0% │",
        "│ other     │       1 │      8 │     8 │ 100.0% │",
        "├───────────┼─────────┼────────┼───────┼────────┤",
        "│ total     │       4 │    216 │    68 │  31.5% │",
        "└───────────┴─────────┴────────┴───────┴────────┘",
    ]


def test_decompress_restores_tensors(tmp_path: Path) -> None:
    tensors = _checkpoint(tmp_path / "in")
    runner = CliRunner()
    assert (
        runner.invoke(cli, ["compress", str(tmp_path / "in"), str(tmp_path / "c")]).exit_code == 0
    )
    result = runner.invoke(cli, ["decompress", str(tmp_path / "c"), str(tmp_path / "d")])
    assert result.exit_code == 0, result.output
    restored = load_file(tmp_path / "d" / "model.safetensors")
    assert all(
        torch.equal(restored[k].view(torch.uint8), v.view(torch.uint8)) for k, v in tensors.items()
    )


def test_corrupted_checkpoint_is_one_red_line(tmp_path: Path) -> None:
    _checkpoint(tmp_path / "in")
    runner = CliRunner()
    runner.invoke(cli, ["compress", str(tmp_path / "in"), str(tmp_path / "c")])
    path = tmp_path / "c" / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    result = runner.invoke(cli, ["decompress", str(tmp_path / "c"), str(tmp_path / "d")])
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr == (
        f"error: {path}: tensor norm.weight: checksum mismatch, the compressed data is corrupted\n"
    )


def test_missing_input_directory_is_a_usage_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["compress", str(tmp_path / "nope"), str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "does not exist" in result.stderr
