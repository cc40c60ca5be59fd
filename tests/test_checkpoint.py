"""CheckpointReader and load_weights on tiny checkpoints written by transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from edgeinfer.daemon.engine.checkpoint import CheckpointReader, load_weights
from edgeinfer.daemon.engine.errors import ModelLoadError
from edgeinfer.daemon.engine.tiny_checkpoint import build_tiny_checkpoint


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("single"), dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(
        tmp_path_factory.mktemp("sharded"), architecture="Qwen2ForCausalLM", sharded=True
    )


def fresh_hf_model(path: Path) -> nn.Module:
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.random.fork_rng(devices=[]):
        model = type(reference)(reference.config)
    return model


def test_reader_single_file(single: Path) -> None:
    with CheckpointReader(single) as reader:
        names = reader.names()
        assert "model.embed_tokens.weight" in names and "lm_head.weight" in reader
        assert reader.shape("model.embed_tokens.weight") == (512, 64)
        assert reader.dtype("model.embed_tokens.weight") == torch.bfloat16
        full = reader.get("model.layers.0.self_attn.q_proj.weight")
        rows = reader.get_slice("model.layers.0.self_attn.q_proj.weight", 0, 16, 32)
        cols = reader.get_slice("model.layers.0.self_attn.q_proj.weight", -1, 8, 24)
        torch.testing.assert_close(rows, full[16:32])
        torch.testing.assert_close(cols, full[:, 8:24])
        with pytest.raises(ModelLoadError, match="not in the checkpoint"):
            reader.get("nope.weight")


def test_reader_missing_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not a safetensors checkpoint"):
        CheckpointReader(tmp_path)


def test_reader_missing_shard(tmp_path: Path) -> None:
    index = {"weight_map": {"a.weight": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="shard"):
        CheckpointReader(tmp_path)


@pytest.mark.parametrize("fixture", ["single", "sharded"])
def test_load_weights_matches_transformers(fixture: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(fixture)
    if fixture == "sharded":
        assert len(list(path.glob("model-*-of-*.safetensors"))) > 1
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = fresh_hf_model(path)
    with CheckpointReader(path) as reader:
        load_weights(model, reader, lambda name: name, torch.float32, show_progress=False)
    expected = reference.state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)


def test_missing_tensor_names_it(single: Path) -> None:
    model = fresh_hf_model(single)
    with CheckpointReader(single) as reader:
        skip = "model.layers.1.mlp.up_proj.weight"
        with pytest.raises(ModelLoadError, match=f"missing tensor {skip}"):
            load_weights(model, reader, lambda n: None if n == skip else n, torch.float32, False)


def test_optional_and_skipped_and_unexpected(tmp_path: Path) -> None:
    tensors = {
        "w.weight": torch.ones(3, 2),
        "rotary_emb.inv_freq": torch.ones(4),  # skipped by the name map
        "extra.weight": torch.zeros(1),  # no such parameter: ignored
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model = nn.ModuleDict({"w": nn.Linear(2, 3, bias=False), "head": nn.Linear(2, 3, bias=False)})
    with CheckpointReader(tmp_path) as reader:
        load_weights(
            model,
            reader,
            lambda n: None if n.startswith("rotary_emb") else n,
            torch.float32,
            show_progress=True,
            optional={"head.weight"},
        )
    torch.testing.assert_close(model["w"].weight, torch.ones(3, 2))


def test_shape_mismatch_names_both_shapes(tmp_path: Path) -> None:
    save_file({"w.weight": torch.ones(4, 2)}, str(tmp_path / "model.safetensors"))
    model = nn.ModuleDict({"w": nn.Linear(2, 3, bias=False)})
    with CheckpointReader(tmp_path) as reader, pytest.raises(ModelLoadError) as info:
        load_weights(model, reader, lambda n: n, torch.float32, show_progress=False)
    assert "w.weight" in str(info.value)
    assert "[4, 2]" in str(info.value) and "[3, 2]" in str(info.value)


def test_tied_checkpoint_without_lm_head(tmp_path: Path) -> None:
    path = build_tiny_checkpoint(tmp_path, tie_word_embeddings=True)
    with CheckpointReader(path) as reader:
        assert "lm_head.weight" not in reader
        with torch.random.fork_rng(devices=[]):
            model = LlamaForCausalLM(AutoModelForCausalLM.from_pretrained(path).config)
        model.lm_head.weight = nn.Parameter(torch.empty_like(model.lm_head.weight))  # untie
        with pytest.raises(ModelLoadError, match=r"missing tensor lm_head\.weight"):
            load_weights(model, reader, lambda n: n, torch.float32, show_progress=False)
        load_weights(
            model,
            reader,
            lambda n: n,
            torch.float32,
            show_progress=False,
            optional={"lm_head.weight"},
        )
