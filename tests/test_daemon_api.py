"""OpenAI endpoints over HTTP: outputs equal the engine's, response and SSE shapes, options."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from daemon_helpers import (
    daemon_config,
    read_events,
    reference_engine,
    start,
)
from edgeinfer.daemon.engine.llm_engine import LLMEngine
from edgeinfer.daemon.engine.sampling_params import SamplingParams
from edgeinfer.daemon.state import STATE_KEY

pytestmark = pytest.mark.asyncio

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def ref(checkpoint: Path) -> LLMEngine:
    return reference_engine(checkpoint)


def chat_prompt_ids(ref: LLMEngine) -> list[int]:
    text = ref.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    return ref.tokenizer.encode(text, add_special_tokens=False)


async def test_completion_greedy_equals_engine(client: Any, ref: LLMEngine) -> None:
    prompts = ["The quick brown fox", "Once upon a time"]
    want = ref.generate(prompts, SamplingParams.greedy_params(12, ignore_eos=True))
    body = {
        "model": "tiny-test",
        "prompt": prompts,
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200
    data = await resp.json()
    assert data["object"] == "text_completion" and data["model"] == "tiny-test"
    assert data["id"].startswith("cmpl-")
    assert [c["index"] for c in data["choices"]] == [0, 1]
    for choice, expected in zip(data["choices"], want):
        assert choice["token_ids"] == expected.token_ids
        assert choice["prompt_token_ids"] == expected.prompt_token_ids
        assert choice["text"] == expected.text
        assert choice["finish_reason"] == "length"
        assert choice["logprobs"] is None
    usage = data["usage"]
    assert usage["prompt_tokens"] == sum(len(w.prompt_token_ids) for w in want)
    assert usage["completion_tokens"] == 24
    assert usage["total_tokens"] == usage["prompt_tokens"] + 24


async def test_token_id_prompts_and_chat_equal_engine(client: Any, ref: LLMEngine) -> None:
    ids = [5, 17, 42, 99, 7]
    want = ref.generate([ids], SamplingParams.greedy_params(8, ignore_eos=True))[0]
    body = {"prompt": [ids], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    data = await (await client.post("/v1/completions", json=body)).json()
    assert data["choices"][0]["text"] == want.text

    chat_ids = chat_prompt_ids(ref)
    want = ref.generate([chat_ids], SamplingParams.greedy_params(8, ignore_eos=True))[0]
    body = {
        "messages": MESSAGES,
        "max_completion_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    resp = await client.post("/v1/chat/completions", json=body)
    data = await resp.json()
    assert data["object"] == "chat.completion" and data["id"].startswith("chatcmpl-")
    choice = data["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": want.text}
    assert choice["token_ids"] == want.token_ids
    assert data["prompt_token_ids"] == chat_ids
    assert data["usage"]["prompt_tokens"] == len(chat_ids)


async def test_completion_stream_sse_format(client: Any, ref: LLMEngine) -> None:
    want = ref.generate(["Hello, how are you"], SamplingParams.greedy_params(6, ignore_eos=True))
    body = {
        "prompt": "Hello, how are you",
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    raw = await resp.read()
    # Every event is exactly `data: <json>\n\n`, the last one `data: [DONE]\n\n`.
    frames = raw.split(b"\n\n")
    assert frames[-1] == b"" and frames[-2] == b"data: [DONE]"
    assert all(f.startswith(b"data: ") for f in frames[:-1])

    resp = await client.post("/v1/completions", json=body)
    events = await read_events(resp)
    assert events[-1] == "[DONE]"
    usage_chunk, chunks = events[-2], events[:-2]
    assert isinstance(usage_chunk, dict) and usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 6
    assert all(isinstance(c, dict) and c["object"] == "text_completion" for c in chunks)
    choices = [c["choices"][0] for c in chunks if isinstance(c, dict)]
    assert "".join(c["text"] for c in choices) == want[0].text
    assert [t for c in choices for t in c["token_ids"]] == want[0].token_ids
    assert choices[0]["prompt_token_ids"] == want[0].prompt_token_ids
    assert all("prompt_token_ids" not in c for c in choices[1:])
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["length"]
    assert all("usage" not in c for c in chunks)


async def test_chat_stream_role_first_and_no_usage_by_default(client: Any) -> None:
    body = {"messages": MESSAGES, "max_tokens": 4, "stream": True, "ignore_eos": True}
    events = await read_events(await client.post("/v1/chat/completions", json=body))
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if isinstance(e, dict)]
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len({c["id"] for c in chunks}) == 1


async def test_completion_logprobs_shape(client: Any, ref: LLMEngine) -> None:
    want = ref.generate(["Numbers count"], SamplingParams.greedy_params(5, logprobs=3))[0]
    body = {"prompt": "Numbers count", "max_tokens": 5, "temperature": 0, "logprobs": 3}
    data = await (await client.post("/v1/completions", json=body)).json()
    lp = data["choices"][0]["logprobs"]
    n = len(want.token_ids)
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["text_offset"]) == len(lp["top_logprobs"]) == n
    assert lp["token_logprobs"] == pytest.approx([t.logprob for t in want.logprobs or []])
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        # Keys are token strings, so alternatives that decode alike share one entry.
        assert 1 <= len(top) <= 4 and top[token] == logprob
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0


async def test_chat_logprobs_shape(client: Any) -> None:
    body = {"messages": MESSAGES, "max_tokens": 3, "logprobs": True, "top_logprobs": 2}
    data = await (await client.post("/v1/chat/completions", json=body)).json()
    content = data["choices"][0]["logprobs"]["content"]
    assert len(content) == data["usage"]["completion_tokens"]
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] == list(entry["token"].encode())
        assert len(entry["top_logprobs"]) == 2
        assert entry["logprob"] <= 0 and set(entry["top_logprobs"][0]) == {
            "token",
            "logprob",
            "bytes",
        }
    # No logprobs unless asked for.
    body = {"messages": MESSAGES, "max_tokens": 2}
    data = await (await client.post("/v1/chat/completions", json=body)).json()
    assert data["choices"][0]["logprobs"] is None


async def test_stop_string_and_seeded_sampling(client: Any) -> None:
    body = {"prompt": "The", "max_tokens": 10, "temperature": 0.9, "seed": 1234}
    a = await (await client.post("/v1/completions", json=body)).json()
    b = await (await client.post("/v1/completions", json=body)).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    text = a["choices"][0]["text"]
    if len(text) > 2:
        stop = text[1:3]
        stopped = await (await client.post("/v1/completions", json={**body, "stop": stop})).json()
        assert stopped["choices"][0]["finish_reason"] == "stop"
        assert stopped["choices"][0]["stop_reason"] == stop
        assert stop not in stopped["choices"][0]["text"]


async def test_models(client: Any) -> None:
    data = await (await client.get("/v1/models")).json()
    assert data["object"] == "list"
    assert [m["id"] for m in data["data"]] == ["tiny-test"]


async def test_prefill_endpoint_reaches_runner(
    aiohttp_client: Any, checkpoint: Path, llm: LLMEngine
) -> None:
    peer = "tcp://p2:5600"
    config = daemon_config(checkpoint, api_key="daemon-key", prefill_peers=(peer,))
    client = await start(aiohttp_client, config, llm)
    runner = client.app[STATE_KEY].runner
    seen: list[str | None] = []
    original = runner.run

    def spy(rid: str, ids: list[int], params: SamplingParams, *rest: Any) -> Any:
        seen.append(rest[0] if rest else None)
        return original(rid, ids, params, *rest)

    runner.run = spy
    key = {"Authorization": "Bearer daemon-key"}
    body = {"prompt": "Hi", "max_tokens": 2}
    with_body = {**body, "kv_transfer_params": {"prefill_endpoint": peer}}
    for sent, headers in [
        (body, key),
        # The router (it presents the key) may name any prefill daemon.
        (body, {**key, "x-edge-prefill": "tcp://p1:5600"}),
        (with_body, key),  # the body only ever names a configured peer
        (with_body, {**key, "x-edge-prefill": "tcp://p1:1"}),  # the router's header wins
    ]:
        assert (await client.post("/v1/completions", json=sent, headers=headers)).status == 200
    assert seen == [None, "tcp://p1:5600", peer, "tcp://p1:1"]
