"""Model spec resolution: presets built once into the cache, directories passed through."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from edgeinfer.daemon.engine.checkpoint import CheckpointReader
from edgeinfer.daemon.engine.default_model import resolve_model
from edgeinfer.daemon.engine.errors import ModelLoadError
from edgeinfer.daemon.engine.model_config import ModelConfig
from edgeinfer.daemon.engine.tokenizer import Tokenizer
from edgeinfer.shared.cache_dir import cache_dir


def test_cache_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("EDGEINFER_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "edgeinfer"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "edgeinfer"
    monkeypatch.setenv("EDGEINFER_CACHE_DIR", str(tmp_path / "own"))
    assert cache_dir() == tmp_path / "own"


def test_tiny_preset_is_built_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("EDGEINFER_CACHE_DIR", str(tmp_path))
    path = resolve_model("tiny", show_progress=False)
    assert path.parent == tmp_path / "models"
    cfg = ModelConfig.from_dir(path)
    assert cfg.architecture == "LlamaForCausalLM" and cfg.num_layers == 2
    tok = Tokenizer.from_dir(path)
    assert tok.vocab_size == cfg.vocab_size
    assert "<|im_start|>assistant" in tok.apply_chat_template([{"role": "user", "content": "hi"}])
    # No temporary build directories are left behind.
    assert sorted(p.name for p in path.parent.iterdir() if p.is_dir()) == [path.name]
    stamp = os.stat(path / "model.safetensors").st_mtime_ns
    assert resolve_model("tiny") == path
    assert os.stat(path / "model.safetensors").st_mtime_ns == stamp


def test_directory_and_unknown_specs(tmp_path: Path) -> None:
    assert resolve_model(str(tmp_path)) == tmp_path
    with pytest.raises(ModelLoadError, match="not a directory"):
        resolve_model(str(tmp_path / "missing"))
    with pytest.raises(ModelLoadError, match="'tiny'"):
        resolve_model("llama-70b")


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("EDGEINFER_TEST_DEFAULT_MODEL") != "1",
    reason="downloads about 90 MB; set EDGEINFER_TEST_DEFAULT_MODEL=1",
)
def test_default_model_conversion() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(None)
    assert resolve_model("smollm2") == path
    cfg = ModelConfig.from_dir(path)
    assert cfg.architecture == "LlamaForCausalLM" and cfg.tie_word_embeddings
    assert (cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    with CheckpointReader(path) as reader:
        assert reader.dtype("model.embed_tokens.weight") == torch.bfloat16

    ours, ref = Tokenizer.from_dir(path), AutoTokenizer.from_pretrained(path)
    assert ours.eos_token_ids == {ours.token_to_id("<|im_end|>")}
    for text in ["Hello world", "你好 🎉 café", "<|im_start|>user\nhi<|im_end|>"]:
        assert ours.encode(text) == ref(text)["input_ids"]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = ours.apply_chat_template(messages)
    assert prompt == ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.tensor([ours.encode(prompt, add_special_tokens=False)])
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in ours.decode(out[0, ids.shape[1] :].tolist())
