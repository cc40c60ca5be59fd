"""Every refusal is a 4xx/5xx with OpenAI's error body, before any token is generated."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from daemon_helpers import MAX_MODEL_LEN, daemon_config, start
from edgeinfer.daemon.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.asyncio

CHAT = [{"role": "user", "content": "hi"}]
LONG_PROMPT = [7] * MAX_MODEL_LEN


@pytest_asyncio.fixture
async def client(aiohttp_client: Any, checkpoint: Path, llm: LLMEngine) -> Any:
    return await start(aiohttp_client, daemon_config(checkpoint), llm)


def assert_openai_error(data: Any, param: str | None, code: str | None = None) -> None:
    assert set(data) == {"error"}
    err = data["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert isinstance(err["message"], str) and err["message"]
    assert err["param"] == param
    if code is not None:
        assert err["code"] == code


BAD_COMPLETIONS = [
    # (case, body, param)
    ("prompt-missing", {"max_tokens": 3}, "prompt"),
    ("prompt-dict", {"prompt": {"text": "x"}}, "prompt"),
    ("prompt-empty-list", {"prompt": []}, "prompt"),
    ("prompt-mixed-list", {"prompt": ["a", 1]}, "prompt"),
    ("token-out-of-vocab", {"prompt": [1, 10**6]}, "prompt"),
    ("prompt-too-long", {"prompt": LONG_PROMPT, "max_tokens": 1}, "prompt"),
    ("max-tokens-zero", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("max-tokens-over-context", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ("max-tokens-string", {"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ("max-tokens-bool", {"prompt": "hi", "max_tokens": True}, "max_tokens"),
    ("temperature-string", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("temperature-negative", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("top-p-zero", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("stop-number", {"prompt": "hi", "stop": 3}, "stop"),
    ("stream-string", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("n-too-many", {"prompt": "hi", "n": 17}, "n"),
    ("n-string", {"prompt": "hi", "n": "1"}, "n"),
    ("logprobs-too-many", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("logprobs-bool", {"prompt": "hi", "logprobs": True}, "logprobs"),
    ("echo-string", {"prompt": "hi", "echo": "yes"}, "echo"),
    ("stream-options-without-stream", {"prompt": "hi", "stream_options": {}}, "stream"),
    (
        "include-usage-string",
        {"prompt": "hi", "stream": True, "stream_options": {"include_usage": "y"}},
        "stream_options.include_usage",
    ),
    (
        "prefill-endpoint",
        {"prompt": "hi", "kv_transfer_params": {"prefill_endpoint": "x"}},
        "kv_transfer_params.prefill_endpoint",
    ),
    ("logit-bias-number", {"prompt": "hi", "logit_bias": 5}, "logit_bias"),
    ("logit-bias-key", {"prompt": "hi", "logit_bias": {"x": 1.0}}, "logit_bias"),
    ("logit-bias-range", {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    (
        "prefill-endpoint-untrusted",
        {"prompt": "hi", "kv_transfer_params": {"prefill_endpoint": "tcp://10.0.0.1:5600"}},
        "kv_transfer_params.prefill_endpoint",
    ),
    (
        "kv-transfer-params-string",
        {"prompt": "hi", "kv_transfer_params": "x"},
        "kv_transfer_params",
    ),
]


@pytest.mark.parametrize(
    ("case", "body", "param"), [pytest.param(*c, id=c[0]) for c in BAD_COMPLETIONS]
)
async def test_bad_completion_request(client: Any, case: str, body: dict, param: str) -> None:
    # Streaming requests are refused the same way: before the SSE headers go out.
    variants = [body]
    if "stream" not in body and "stream_options" not in body:
        variants.append({**body, "stream": True})
    for sent in variants:
        resp = await client.post("/v1/completions", json=sent)
        assert resp.status == 400, case
        assert resp.content_type == "application/json"
        assert_openai_error(await resp.json(), param)


BAD_CHATS = [
    ("messages-missing", {}, "messages"),
    ("messages-string", {"messages": "hi"}, "messages"),
    ("message-no-role", {"messages": [{"content": "hi"}]}, "messages[0]"),
    ("content-number", {"messages": [{"role": "user", "content": 3}]}, "messages[0]"),
    (
        "image-part",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        "messages[0]",
    ),
    ("unknown-role", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("logprobs-int", {"messages": CHAT, "logprobs": 2}, "logprobs"),
    ("top-logprobs-alone", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("max-completion-tokens", {"messages": CHAT, "max_completion_tokens": 10**6}, "max_tokens"),
    ("tools", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools[0].function"),
    (
        "kwargs-messages",
        {"messages": CHAT, "chat_template_kwargs": {"messages": []}},
        "chat_template_kwargs.messages",
    ),
    (
        "kwargs-add-generation-prompt",
        {"messages": CHAT, "chat_template_kwargs": {"add_generation_prompt": True}},
        "chat_template_kwargs.add_generation_prompt",
    ),
]


@pytest.mark.parametrize(("case", "body", "param"), [pytest.param(*c, id=c[0]) for c in BAD_CHATS])
async def test_bad_chat_request(client: Any, case: str, body: dict, param: str) -> None:
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 400, case
    assert_openai_error(await resp.json(), param)


async def test_context_length_message(client: Any) -> None:
    resp = await client.post(
        "/v1/completions", json={"prompt": LONG_PROMPT[:-10], "max_tokens": 20}
    )
    data = await resp.json()
    assert_openai_error(data, "max_tokens", "context_length_exceeded")
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in data["error"]["message"]


@pytest.mark.parametrize("raw", [b"{bad json", b"[1, 2]", b'"text"', b""])
async def test_malformed_body(client: Any, raw: bytes) -> None:
    resp = await client.post(
        "/v1/completions", data=raw, headers={"Content-Type": "application/json"}
    )
    assert resp.status == 400
    assert_openai_error(await resp.json(), None)


async def test_unknown_model_is_404(client: Any) -> None:
    for path, body in (
        ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}),
        ("/v1/chat/completions", {"model": "gpt-4", "messages": CHAT}),
    ):
        resp = await client.post(path, json=body)
        assert resp.status == 404
        assert_openai_error(await resp.json(), "model", "model_not_found")


async def test_unknown_fields_are_ignored(client: Any) -> None:
    body = {"prompt": "hi", "max_tokens": 2, "user": "u1", "some_vendor_field": {"x": 1}}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200


async def test_unknown_route_and_method(client: Any) -> None:
    resp = await client.get("/v1/nothing")
    assert resp.status == 404
    assert_openai_error(await resp.json(), None)
    resp = await client.get("/v1/completions")
    assert resp.status == 405
    assert_openai_error(await resp.json(), None)


async def test_untrusted_prefill_header(client: Any) -> None:
    # No api_key and no configured peers: nobody may steer this daemon's KV plane.
    for path, body in (
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": CHAT}),
    ):
        resp = await client.post(path, json=body, headers={"x-edge-prefill": "tcp://10.0.0.1:5600"})
        assert resp.status == 400
        assert_openai_error(await resp.json(), "x-edge-prefill", "untrusted_prefill_endpoint")


@pytest.mark.parametrize("kind", ["completion", "chat"])
async def test_huge_prompt_is_refused_before_a_full_tokenisation(
    client: Any, llm: LLMEngine, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    text = "the quick brown fox jumps over the lazy dog " * 50_000  # ~2 MiB
    encoded: list[int] = []
    encode = llm.tokenizer.encode

    def spy(piece: str, add_special_tokens: bool = True) -> list[int]:
        encoded.append(len(piece))
        return encode(piece, add_special_tokens)

    monkeypatch.setattr(llm.tokenizer, "encode", spy)
    if kind == "chat":
        path, body, param = (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": text}]},
            "messages",
        )
    else:
        path, body, param = "/v1/completions", {"prompt": text}, "prompt"
    resp = await client.post(path, json=body)
    assert resp.status == 400
    data = await resp.json()
    assert_openai_error(data, param, "context_length_exceeded")
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in data["error"]["message"]
    # Refused on its length alone (api/token_bytes.py): not even a prefix was tokenised.
    assert encoded == []
