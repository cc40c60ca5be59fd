"""The engine loads compressed checkpoints transparently and bit-exactly, or refuses them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from edgeinfer.daemon.engine.checkpoint import CheckpointReader
from edgeinfer.daemon.engine.config import EngineConfig
from edgeinfer.daemon.engine.errors import EngineError, ModelLoadError
from edgeinfer.daemon.engine.llm_engine import LLMEngine
from edgeinfer.daemon.engine.sampling_params import SamplingParams
from edgeinfer.daemon.engine.tiny_checkpoint import build_tiny_checkpoint
from edgeinfer.kernels.compression.checkpoint import compress_dir
from edgeinfer.kernels.compression.errors import CorruptDataError

PROMPTS = [[5, 17, 42, 99, 7], [300, 12, 8], list(range(20, 60))]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
WEIGHT = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny bf16 checkpoint (sharded, to cover the index path) and its compressed copy."""
    root = tmp_path_factory.mktemp("ckpt")
    original = build_tiny_checkpoint(root / "plain", dtype=torch.bfloat16, sharded=True)
    compress_dir(original, root / "compressed")
    return original, root / "compressed"


def _run(model: Path, **config: object) -> tuple[list[list[int]], torch.Tensor]:
    engine = LLMEngine(EngineConfig(model=str(model), show_progress=False, **config))
    tokens = [c.token_ids for c in engine.generate(PROMPTS, GREEDY)]
    return tokens, engine.prompt_logits(PROMPTS[2])


def test_reader_serves_compressed_checkpoint(checkpoints: tuple[Path, Path]) -> None:
    original, compressed = checkpoints
    with CheckpointReader(original) as plain, CheckpointReader(compressed) as packed:
        assert packed.names() == plain.names()
        for name in plain.names():
            assert packed.shape(name) == plain.shape(name)
            assert packed.dtype(name) == plain.dtype(name)
            assert torch.equal(
                packed.get(name).view(torch.int16), plain.get(name).view(torch.int16)
            )
        assert torch.equal(packed.get_slice(WEIGHT, -1, 8, 24), plain.get_slice(WEIGHT, -1, 8, 24))
        assert packed.get_compressed(WEIGHT) is not None and plain.get_compressed(WEIGHT) is None


@pytest.mark.parametrize("mode", ["decompress_at_load", "per_layer"])
def test_engine_output_is_bit_identical(checkpoints: tuple[Path, Path], mode: str) -> None:
    original, compressed = checkpoints
    tokens, logits = _run(original)
    packed_tokens, packed_logits = _run(compressed, compressed_weights=mode)
    assert packed_tokens == tokens
    assert torch.equal(packed_logits, logits)


def test_per_layer_keeps_layer_weights_compressed(checkpoints: tuple[Path, Path]) -> None:
    engine = LLMEngine(
        EngineConfig(model=str(checkpoints[1]), show_progress=False, compressed_weights="per_layer")
    )
    params = dict(engine.runner.model.named_parameters())
    assert params[WEIGHT].numel() == 0  # only decoded while its layer runs
    assert params["model.embed_tokens.weight"].numel() > 0


def test_unknown_mode_is_rejected() -> None:
    with pytest.raises(EngineError, match="compressed_weights"):
        EngineConfig(compressed_weights="lazy")  # type: ignore[arg-type]


def _shard_of(model_dir: Path, name: str) -> Path:
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    return model_dir / index["weight_map"][name]


def test_corrupted_checkpoint_fails_at_load(checkpoints: tuple[Path, Path], tmp_path: Path) -> None:
    damaged = tmp_path / "damaged"
    compress_dir(checkpoints[0], damaged)
    shard = _shard_of(damaged, WEIGHT)
    tensors = load_file(shard)
    with safe_open(str(shard), framework="pt") as handle:
        metadata = handle.metadata()
    tensors[f"{WEIGHT}::ei.raw"][3] ^= 0x40  # one flipped mantissa bit
    save_file(tensors, shard, metadata=metadata)
    with pytest.raises(ModelLoadError, match="checksum mismatch") as info:
        LLMEngine(EngineConfig(model=str(damaged), show_progress=False))
    assert WEIGHT in str(info.value)
    assert isinstance(info.value.__cause__, CorruptDataError)
