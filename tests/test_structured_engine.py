"""Grammar-constrained decoding in the engine: the batch mask, completion, preemption, errors.

The tiny model has random weights: whatever it writes under a constraint is valid only because
of the grammar, which is what these tests check.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from edgeinfer.daemon.engine.config import EngineConfig
from edgeinfer.daemon.engine.errors import InvalidRequestError
from edgeinfer.daemon.engine.llm_engine import LLMEngine
from edgeinfer.daemon.engine.sampling_params import SamplingParams
from edgeinfer.daemon.engine.structured import StructuredSpec, apply_token_masks
from edgeinfer.daemon.engine.tiny_checkpoint import build_tiny_checkpoint
from engine_helpers import random_prompts

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "ok", "size", "color"],
    "additionalProperties": False,
}


def check_schema(text: str) -> None:
    data = json.loads(text)
    assert list(data) == ["name", "ok", "size", "color"]  # the schema's order
    assert isinstance(data["name"], str) and len(data["name"]) <= 6
    assert isinstance(data["ok"], bool)
    assert type(data["size"]) is int and 0 <= data["size"] <= 99
    assert data["color"] in ("red", "green", "blue")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("structured") / "m")


@pytest.fixture(scope="module")
def engine(ckpt: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(ckpt)))


def test_constrained_and_unconstrained_rows_share_a_batch(engine: LLMEngine) -> None:
    spec = StructuredSpec.json_schema(SCHEMA, "response_format")
    free = SamplingParams(max_tokens=12, temperature=1.0, seed=7)
    params = [
        SamplingParams(max_tokens=200, temperature=1.0, seed=s, structured=spec) for s in range(4)
    ]
    want_free = engine.generate(["hi"], free)[0]
    out = engine.generate(["hi"] * 5, [*params, free])
    for c in out[:4]:
        assert c.finish_reason == "stop"  # the grammar completed: the sequence ended there
        check_schema(c.text)
    # The unconstrained row is sampled exactly as it is alone.
    assert out[4].token_ids == want_free.token_ids


@pytest.mark.parametrize(
    ("spec", "check"),
    [
        (StructuredSpec("regex", r"[0-9]{3}-[a-z]{2}", "guided_regex"), r"[0-9]{3}-[a-z]{2}"),
        (StructuredSpec.choice(["alpha", "beta", "gamma"], "guided_choice"), r"alpha|beta|gamma"),
        (
            StructuredSpec("grammar", 'root ::= "yes" | "no" | "maybe " [0-9]', "guided_grammar"),
            r"yes|no|maybe [0-9]",
        ),
        (StructuredSpec("grammar", 'start: "a"+ "b"', "guided_grammar"), r"a+b"),
    ],
)
def test_regex_choice_and_grammars(engine: LLMEngine, spec: StructuredSpec, check: str) -> None:
    params = [
        SamplingParams(max_tokens=40, temperature=1.0, seed=s, structured=spec) for s in range(3)
    ]
    for c in engine.generate(["pick"] * 3, params):
        assert re.fullmatch(check, c.text), c.text


def test_json_object_mode(engine: LLMEngine) -> None:
    spec = StructuredSpec("json_object", "", "response_format")
    params = SamplingParams(max_tokens=60, temperature=0.0, structured=spec)
    c = engine.generate(["x"], params)[0]
    # Unbounded strings may run out of tokens; when the object closed it is valid JSON.
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.text), dict)
    else:
        assert c.text.startswith("{")


def test_preempted_request_keeps_its_grammar_state(ckpt: Path) -> None:
    # Two requests outgrow a 16-block pool while decoding; the later one is preempted and
    # recomputed. Its matcher stays in step with its tokens: output equals the unpreempted one.
    spec = StructuredSpec("regex", r"[a-z ]{400}", "guided_regex")
    prompts = random_prompts(2, 512, 64, 64, seed=33)
    params = SamplingParams(max_tokens=120, temperature=0.0, structured=spec)
    want = [c.text for c in LLMEngine(EngineConfig(model=str(ckpt))).generate(prompts, params)]
    small = LLMEngine(EngineConfig(model=str(ckpt), num_kv_blocks=16))
    got = [c.text for c in small.generate(prompts, params)]
    assert small.stats().num_preemptions > 0, "the small pool was meant to force preemption"
    assert got == want
    assert all(re.fullmatch(r"[a-z ]+", t) for t in got)


def test_remote_commit_advances_the_matcher(engine: LLMEngine) -> None:
    # Decode side of a disaggregated request: the first token arrives from the prefill side.
    spec = StructuredSpec.choice(["left", "right"], "guided_choice")
    params = SamplingParams(max_tokens=10, temperature=0.0, structured=spec)
    want = engine.generate(["go"], params)[0]
    prompt = engine.tokenizer.encode("go")
    engine.reserve_remote("remote", prompt, params)
    out = engine.commit_remote("remote", want.token_ids[0])
    tokens = list(out.new_token_ids)
    while not out.finished:
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    assert tokens == want.token_ids
    assert engine.tokenizer.decode(tokens) in ("left", "right")


def test_spec_survives_the_wire_map() -> None:
    spec = StructuredSpec.json_schema(json.dumps(SCHEMA, indent=2), "structured_outputs.json")
    params = SamplingParams(max_tokens=5, structured=spec)
    wired = dataclasses.asdict(params)
    assert wired["structured"] == {
        "kind": "json",
        "source": json.dumps(SCHEMA, separators=(",", ":")),
        "param": "structured_outputs.json",
    }
    assert SamplingParams(**wired) == params


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredSpec("regex", "a(b", "guided_regex"), "unclosed group"),
        (StructuredSpec("grammar", "root ::= (", "guided_grammar"), ""),
        (
            StructuredSpec.json_schema({"type": "object", "$ref": "#/nowhere"}, "response_format"),
            "",
        ),
    ],
)
def test_compile_errors_name_the_field(engine: LLMEngine, spec: StructuredSpec, message: str):
    with pytest.raises(InvalidRequestError) as err:
        engine.grammars.compile(spec)
    assert err.value.param == spec.param
    assert message in str(err.value)


def test_compiled_grammars_are_cached(engine: LLMEngine) -> None:
    spec = StructuredSpec.json_schema(
        {"type": "object", "properties": {"q": {"type": "null"}}}, "x"
    )
    assert not engine.grammars.is_cached(spec)
    first = engine.grammars.compile(spec)
    assert engine.grammars.is_cached(spec)
    # Same schema with other spacing: the same cache entry.
    again = StructuredSpec.json_schema(
        '{ "type": "object", "properties": {"q": {"type": "null"}}}', "y"
    )
    assert engine.grammars.compile(again) is first


def test_mask_touches_only_constrained_rows(engine: LLMEngine) -> None:
    spec = StructuredSpec.choice(["left"], "guided_choice")
    matcher = engine.grammars.matcher(spec)
    vocab = engine.model_config.vocab_size
    logits = torch.randn(3, vocab)
    before = logits.clone()
    apply_token_masks(logits, [1], [matcher])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed
    assert all("left".startswith(engine.tokenizer.decode([t])) for t in allowed)
