"""Tokenizer parity with transformers, chat templates, and incremental detokenization."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from edgeinfer.daemon.engine.errors import InvalidRequestError, ModelLoadError
from edgeinfer.daemon.engine.tiny_checkpoint import CHAT_TEMPLATE, write_tokenizer
from edgeinfer.daemon.engine.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello world",
    " leading space and  double  spaces",
    "The capital of France is Paris.",
    "CJK 你好，世界 and emoji 🎉🚀 and accents café naïve",
    "<|im_start|>user\nhi<|im_end|></s>",
    "",
]
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2? 🤔"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?", "name": None},
]
# Exercises namespace, loop controls, tojson (non-ASCII kept), tools and special-token variables.
FANCY_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(n=0) %}\n"
    "{% for m in messages %}\n"
    "  {% if m.role == 'system' %}{% continue %}{% endif %}\n"
    "  {% set ns.n = ns.n + 1 %}\n"
    "[{{ ns.n }}] {{ m.role }}: {{ m.content | tojson }}{{ eos_token }}\n"
    "{% endfor %}\n"
    "{% if tools %}TOOLS {{ tools | tojson(indent=2) }}\n{% endif %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(path, 512)
    return path


def with_config(src: Path, dst: Path, **changes: Any) -> Path:
    shutil.copytree(src, dst)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    cfg_path.write_text(json.dumps(cfg))
    return dst


def test_special_ids_and_vocab(tok_dir: Path) -> None:
    tok = Tokenizer.from_dir(tok_dir)
    assert tok.bos_token_id == tok.token_to_id("<s>")
    # eos from tokenizer_config (dict spelling) plus both ids of generation_config.json.
    assert tok.eos_token_ids == {tok.token_to_id("</s>"), tok.token_to_id("<|im_end|>")}
    assert tok.vocab_size == 512


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tok_dir: Path, text: str) -> None:
    ours, ref = Tokenizer.from_dir(tok_dir), AutoTokenizer.from_pretrained(tok_dir)
    ids = ours.encode(text)
    assert ids == ref(text)["input_ids"]
    assert ids[0] == ours.bos_token_id
    assert (
        ours.encode(text, add_special_tokens=False)
        == ref(text, add_special_tokens=False)["input_ids"]
    )
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids)


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, FANCY_TEMPLATE], ids=["chatml", "fancy"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tok_dir: Path, tmp_path: Path, template: str, add_generation_prompt: bool
) -> None:
    path = with_config(tok_dir, tmp_path / "t", chat_template=template)
    ours, ref = Tokenizer.from_dir(path), AutoTokenizer.from_pretrained(path)
    tools = [{"type": "function", "function": {"name": "météo", "parameters": {}}}]
    for kwargs in ({}, {"tools": tools}):
        expected = ref.apply_chat_template(
            MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
        )
        assert ours.apply_chat_template(MESSAGES, add_generation_prompt, **kwargs) == expected


def test_template_sources(tok_dir: Path, tmp_path: Path) -> None:
    named = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]
    listed = Tokenizer.from_dir(with_config(tok_dir, tmp_path / "list", chat_template=named))
    assert listed.apply_chat_template(MESSAGES) == "D"
    assert listed.apply_chat_template(MESSAGES, tools=[{"name": "x"}]) == "T"

    jinja_dir = with_config(tok_dir, tmp_path / "jinja", chat_template=None)
    (jinja_dir / "chat_template.jinja").write_text(
        "{{ messages | length }}|{{ strftime_now('%Y') }}"
    )
    rendered = Tokenizer.from_dir(jinja_dir).apply_chat_template(MESSAGES)
    assert rendered.startswith("4|20")

    bare = Tokenizer.from_dir(with_config(tok_dir, tmp_path / "bare", chat_template=None))
    with pytest.raises(InvalidRequestError, match="no chat template") as info:
        bare.apply_chat_template(MESSAGES)
    assert info.value.param == "messages"


def test_raise_exception_becomes_invalid_request(tok_dir: Path) -> None:
    with pytest.raises(InvalidRequestError, match="unknown role tool"):
        Tokenizer.from_dir(tok_dir).apply_chat_template([{"role": "tool", "content": "x"}])


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize(
    "text",
    ["你好，世界！", "emoji 🎉🚀👩‍👩‍👧 end", "mixed café 日本語 🤖 text", "plain ascii only."],
)
@pytest.mark.parametrize("prompt", ["", "Prompt ending in CJK 你好"])
def test_incremental_detokenizer_multibyte(tok_dir: Path, text: str, prompt: str) -> None:
    tok = Tokenizer.from_dir(tok_dir)
    prompt_ids = tok.encode(prompt)
    output_ids = tok.encode(text, add_special_tokens=False)
    # The tiny vocabulary splits every non-ASCII character into several byte tokens.
    if not text.isascii():
        assert len(output_ids) > len(text.encode("utf-8")) // 2
    detok = IncrementalDetokenizer(tok, prompt_ids)
    deltas = [detok.push(i) for i in [*output_ids, tok.token_to_id("</s>")]]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(output_ids) == text
    assert detok.text == text


def test_incremental_detokenizer_keeps_special_tokens_when_asked(tok_dir: Path) -> None:
    tok = Tokenizer.from_dir(tok_dir)
    ids = [*tok.encode("hi", add_special_tokens=False), tok.token_to_id("<|im_end|>")]
    detok = IncrementalDetokenizer(tok, tok.encode("x"), skip_special_tokens=False)
    assert "".join(detok.push(i) for i in ids) == "hi<|im_end|>"
