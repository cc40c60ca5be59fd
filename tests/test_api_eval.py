"""Evaluation features of the OpenAI API: n, echo, prompt logprobs, logit_bias, usage in every
chunk, and the 400s for fields that would change what is generated but are not served."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import jsonschema_rs
import pytest
import torch

from daemon_helpers import (
    engine_stats,
    read_events,
    reference_engine,
)
from edgeinfer.daemon.engine.llm_engine import LLMEngine
from edgeinfer.daemon.engine.sampling_params import SamplingParams
from edgeinfer.shared.openapi import openapi_document

pytestmark = pytest.mark.asyncio

PROMPT = "The quick brown fox jumps over the lazy dog because"


@pytest.fixture(scope="module")
def ref(checkpoint: Path) -> LLMEngine:
    return reference_engine(checkpoint)


def prompt_scores(ref: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Reference log-probs ``[T-1]`` of prompt tokens 1.. from one full forward pass."""
    logprobs = torch.log_softmax(ref.prompt_logits(ids), dim=-1)
    return logprobs[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)


async def post(client: Any, path: str, body: dict[str, Any], status: int = 200) -> Any:
    resp = await client.post(path, json=body)
    data = await resp.json()
    assert resp.status == status, data
    return data


async def test_echo_max_tokens_0_scores_the_prompt(client: Any, ref: LLMEngine) -> None:
    ids = ref.tokenizer.encode(PROMPT)
    body = {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
    data = await post(client, "/v1/completions", body)
    choice = data["choices"][0]
    assert choice["text"] == PROMPT
    assert choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert lp["tokens"] == [ref.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = prompt_scores(ref, ids).tolist()
    for got, expected in zip(lp["token_logprobs"][1:], want, strict=True):
        assert math.isclose(got, expected, abs_tol=1e-5)
    for top, token in zip(lp["top_logprobs"][1:], lp["tokens"][1:]):
        assert token in top and 1 <= len(top) <= 2
    assert data["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": 0,
        "total_tokens": len(ids),
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_prompt_logprobs_in_vllm_shape_and_chunked(client: Any, ref: LLMEngine) -> None:
    ids = ref.tokenizer.encode(PROMPT * 6)  # longer than one prefill chunk in some configs
    body = {"prompt": ids, "max_tokens": 3, "prompt_logprobs": 2, "temperature": 0}
    data = await post(client, "/v1/completions", body)
    choice = data["choices"][0]
    scores = choice["prompt_logprobs"]
    assert len(scores) == len(ids) and scores[0] is None
    want = prompt_scores(ref, ids).tolist()
    for i, entry in enumerate(scores[1:], 1):
        mine = entry[str(ids[i])]
        assert math.isclose(mine["logprob"], want[i - 1], abs_tol=1e-5)
        assert mine["rank"] >= 1 and isinstance(mine["decoded_token"], str)
        ranks = sorted(e["rank"] for k, e in entry.items() if k != str(ids[i]))
        assert ranks == [1, 2][: len(ranks)] and len(entry) in (2, 3)
    expected = ref.generate([ids], SamplingParams.greedy_params(3))[0]
    assert choice["text"] == expected.text
    # A prompt-logprobs request takes no prefix-cache hit: it must see every position.
    again = await post(client, "/v1/completions", body)
    assert again["choices"][0]["prompt_logprobs"] == scores


async def test_echo_prepends_the_prompt_and_streams_it_first(client: Any, ref: LLMEngine) -> None:
    body = {"prompt": PROMPT, "max_tokens": 4, "echo": True, "temperature": 0}
    data = await post(client, "/v1/completions", body)
    expected = ref.generate([PROMPT], SamplingParams.greedy_params(4))[0]
    assert data["choices"][0]["text"] == PROMPT + expected.text
    resp = await client.post("/v1/completions", json={**body, "stream": True})
    events = [e for e in await read_events(resp) if isinstance(e, dict)]
    text = "".join(e["choices"][0]["text"] for e in events)
    assert events[0]["choices"][0]["text"].startswith(PROMPT)
    assert text == PROMPT + expected.text


async def test_n_choices_seeded_reproducible_and_prefilled_once(client: Any) -> None:
    body = {"prompt": PROMPT * 4, "max_tokens": 6, "n": 3, "seed": 7, "temperature": 1.0}
    before = await engine_stats(client)
    data = await post(client, "/v1/completions", body)
    after = await engine_stats(client)
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    texts = [c["text"] for c in data["choices"]]
    assert len(set(texts)) > 1, "per-choice seeds must make choices differ"
    # Choice i is exactly the n=1 request with seed + i.
    for i, text in enumerate(texts):
        single = await post(client, "/v1/completions", {**body, "n": 1, "seed": 7 + i})
        assert single["choices"][0]["text"] == text
    prompt_tokens = data["usage"]["prompt_tokens"]
    assert prompt_tokens == single["usage"]["prompt_tokens"]  # counted once
    assert data["usage"]["completion_tokens"] == 18
    # The later choices took the first one's full blocks from the prefix cache.
    computed = after.prompt_tokens_computed - before.prompt_tokens_computed
    assert computed < 3 * prompt_tokens
    assert after.prefix_cache_hits > before.prefix_cache_hits


async def test_n_streams_carry_choice_index_and_usage(client: Any) -> None:
    body = {
        "prompt": [PROMPT, "Hello"],
        "max_tokens": 3,
        "n": 2,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    resp = await client.post("/v1/completions", json=body)
    events = [e for e in await read_events(resp) if isinstance(e, dict)]
    chunks = [e for e in events if e["choices"]]
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1, 2, 3}
    assert all("usage" in c for c in events)
    done = [c["usage"]["completion_tokens"] for c in chunks]
    assert done == sorted(done) and events[-1]["usage"]["completion_tokens"] == 12
    by_index: dict[int, str] = {}
    for c in chunks:
        item = c["choices"][0]
        by_index[item["index"]] = by_index.get(item["index"], "") + item["text"]
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3]  # greedy: all equal


async def test_chat_n_and_prompt_logprobs(client: Any) -> None:
    body = {
        "messages": [{"role": "user", "content": "Hi there"}],
        "max_tokens": 3,
        "n": 2,
        "temperature": 0,
        "prompt_logprobs": 0,
    }
    data = await post(client, "/v1/chat/completions", body)
    assert [c["index"] for c in data["choices"]] == [0, 1]
    assert data["choices"][0]["message"] == data["choices"][1]["message"]
    scores = data["prompt_logprobs"]
    assert scores[0] is None and all(len(e) == 1 for e in scores[1:])
    assert len(scores) == data["usage"]["prompt_tokens"]


async def test_logit_bias_forces_and_bans_tokens(client: Any, ref: LLMEngine) -> None:
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logit_bias": {"42": 100}}
    data = await post(client, "/v1/completions", {**body, "return_token_ids": True})
    assert data["choices"][0]["token_ids"] == [42] * 4
    greedy = ref.generate([PROMPT], SamplingParams.greedy_params(1))[0].token_ids[0]
    banned = {**body, "max_tokens": 1, "logit_bias": {str(greedy): -100}}
    data = await post(client, "/v1/completions", {**banned, "return_token_ids": True})
    assert data["choices"][0]["token_ids"] != [greedy]


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/completions", {"n": 17}, "n"),
        ("/v1/completions", {"n": 2, "best_of": 3}, "best_of"),
        ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"1": 101}}, "logit_bias"),
        ("/v1/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/completions", {"suffix": "x"}, "suffix"),
        ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
        ("/v1/completions", {"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
        ("/v1/chat/completions", {"echo": True}, "echo"),
        ("/v1/chat/completions", {"function_call": "auto"}, "function_call"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ],
)
async def test_fields_that_would_change_the_output_are_refused(
    client: Any, path: str, extra: dict[str, Any], param: str
) -> None:
    base: dict[str, Any] = (
        {"prompt": "Hi"}
        if path == "/v1/completions"
        else {"messages": [{"role": "user", "content": "Hi"}]}
    )
    data = await post(client, path, {**base, "max_tokens": 2, **extra}, status=400)
    assert data["error"]["param"] == param


async def test_harmless_unknown_fields_stay_accepted(client: Any) -> None:
    body = {"prompt": "Hi", "max_tokens": 2, "user": "u1", "some_vendor_extra": {"a": 1}}
    await post(client, "/v1/completions", body)


def validator(name: str) -> jsonschema_rs.Validator:
    root = {"$ref": f"#/components/schemas/{name}", "components": openapi_document()["components"]}
    return jsonschema_rs.validator_for(root)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_answers_match_the_openapi_document(client: Any, path: str) -> None:
    chat = path.endswith("chat/completions")
    body: dict[str, Any] = {"n": 2, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1}
    if chat:
        body |= {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True}
    else:
        body |= {"prompt": [PROMPT, [5, 6, 7]], "echo": True, "logprobs": 2}
    whole, chunk = (
        ("ChatCompletion", "ChatCompletionChunk") if chat else ("Completion", "CompletionChunk")
    )
    validator(whole).validate(await post(client, path, body))
    options = {"include_usage": True, "continuous_usage_stats": True}
    resp = await client.post(path, json={**body, "stream": True, "stream_options": options})
    events = await read_events(resp)
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        validator(chunk).validate(event)
