"""``POST /tokenize`` and ``/detokenize`` in vLLM's shapes, behind the daemon key like /v1."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema_rs
import pytest
import pytest_asyncio

from daemon_helpers import daemon_config, start
from edgeinfer.daemon.engine.llm_engine import LLMEngine
from edgeinfer.shared.openapi import openapi_document

pytestmark = pytest.mark.asyncio

KEY = "tokenize-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest_asyncio.fixture
async def client(aiohttp_client: Any, checkpoint: Path, llm: LLMEngine) -> Any:
    return await start(aiohttp_client, daemon_config(checkpoint, api_key=KEY), llm)


async def call(client: Any, path: str, body: dict[str, Any], status: int = 200) -> Any:
    resp = await client.post(path, json=body, headers=AUTH)
    data = await resp.json()
    assert resp.status == status, data
    # Every answer is as the OpenAPI document says.
    name = (
        "Error"
        if status != 200
        else "TokenizeResponse"
        if path == "/tokenize"
        else "DetokenizeResponse"
    )
    root = {"$ref": f"#/components/schemas/{name}", "components": openapi_document()["components"]}
    jsonschema_rs.validator_for(root).validate(data)
    return data


async def test_tokenize_a_prompt(client: Any, llm: LLMEngine) -> None:
    text = "Hello world, tokenize me"
    data = await call(client, "/tokenize", {"prompt": text, "return_token_strs": True})
    ids = llm.tokenizer.encode(text)
    assert data["tokens"] == ids and data["count"] == len(ids)
    assert data["max_model_len"] == llm.max_model_len
    assert data["token_strs"] == [llm.tokenizer.id_to_token(t) for t in ids]
    plain = await call(client, "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert plain["tokens"] == llm.tokenizer.encode(text, add_special_tokens=False)
    assert "token_strs" not in plain


async def test_tokenize_messages_as_chat_prefills_them(client: Any, llm: LLMEngine) -> None:
    data = await call(client, "/tokenize", {"messages": MESSAGES, "model": "tiny-test"})
    assert data["tokens"] == llm.encode_chat(MESSAGES)
    # The chat endpoint counts exactly these tokens as its prompt.
    resp = await client.post(
        "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}, headers=AUTH
    )
    assert (await resp.json())["usage"]["prompt_tokens"] == data["count"]
    bare = await call(client, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert bare["count"] < data["count"]


async def test_detokenize_round_trips(client: Any, llm: LLMEngine) -> None:
    ids = llm.tokenizer.encode("round trip text", add_special_tokens=False)
    data = await call(client, "/detokenize", {"tokens": ids})
    assert data == {"prompt": "round trip text"}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
        ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ],
)
async def test_bad_input_is_a_400_naming_the_field(
    client: Any, path: str, body: dict[str, Any], param: str
) -> None:
    data = await call(client, path, body, status=404 if param == "model" else 400)
    assert data["error"]["param"] == param


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
async def test_the_daemon_key_is_required(client: Any, path: str) -> None:
    resp = await client.post(path, json={"prompt": "a", "tokens": [1]})
    assert resp.status == 401
    assert (await resp.json())["error"]["code"] == "invalid_api_key"
