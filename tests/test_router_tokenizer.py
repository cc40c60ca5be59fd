"""The router's prompt ids and block keys equal the engine's, for every tiny architecture."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from daemon_helpers import build_checkpoint, daemon_config, load_engine, start
from edgeinfer.daemon.api.cache_salt import effective_cache_salt
from edgeinfer.daemon.api.protocol import ModelInfo, parse_request
from edgeinfer.daemon.engine.config import EngineConfig
from edgeinfer.daemon.engine.llm_engine import LLMEngine
from edgeinfer.daemon.engine.sampling_params import SamplingParams
from edgeinfer.daemon.kv_events import tokenizer_description
from edgeinfer.router.errors import RouterError
from edgeinfer.router.router_tokenizer import CHAT_PATH, COMPLETIONS_PATH, RouterTokenizer
from engine_helpers import ARCHITECTURES, make_checkpoint

LONG = " ".join(["the quick brown fox jumps over the lazy dog"] * 12)
CHAT = {
    "messages": [
        {"role": "system", "content": "You are a helpful assistant. " + LONG},
        {
            "role": "user",
            "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": LONG}],
        },
        {"role": "assistant", "content": "hi there " + LONG},
        {"role": "user", "content": "and again"},
    ],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
# A conversation that called a tool and read its result.
TOOL_HISTORY = [
    *CHAT["messages"],
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
        {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "rain"},
    {"role": "tool", "tool_call_id": "c2", "content": "noon"},
]  # fmt: skip
TOOL_BODIES = [
    {**CHAT, "tools": [WEATHER, TIME]},
    {"messages": TOOL_HISTORY, "tools": [WEATHER, TIME], "tool_choice": "auto"},
    {"messages": TOOL_HISTORY, "tools": [WEATHER], "tool_choice": "none"},
    {**CHAT, "tools": [WEATHER, TIME], "tool_choice": "required"},
    {
        **CHAT,
        "tools": [TIME],
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
    },
    {"messages": TOOL_HISTORY},  # calls and results, no tools offered any more
    {"messages": TOOL_HISTORY, "tools": []},
]
BODIES = [
    ("chat", CHAT_PATH, CHAT, None),
    ("chat", CHAT_PATH, {**CHAT, "add_generation_prompt": False}, "tenant-a"),
    ("chat", CHAT_PATH, {**CHAT, "cache_salt": "mine"}, "tenant-a"),
    ("completion", COMPLETIONS_PATH, {"prompt": LONG}, None),
    ("completion", COMPLETIONS_PATH, {"prompt": LONG, "add_special_tokens": False}, "t"),
    ("completion", COMPLETIONS_PATH, {"prompt": LONG, "cache_salt": "x"}, None),
    ("completion", COMPLETIONS_PATH, {"prompt": list(range(5, 70))}, "t"),
    *(("chat", CHAT_PATH, body, "tenant-a") for body in TOOL_BODIES),
]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def engine(request, tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("ckpt"), request.param)
    return LLMEngine(EngineConfig(model=str(path), block_size=16, num_kv_blocks=256))


def _engine_keys(engine: LLMEngine, kind, body, header_salt) -> tuple[list[int], set[bytes]]:
    """What the daemon does with the body: its ids, and the keys its engine caches for them."""
    tok = engine.tokenizer
    info = ModelInfo("m", tok, tok.vocab_size, 4096, 4096)
    ids = parse_request(kind, {**body, "max_tokens": 1}, info, None).prompts[0]
    engine.block_manager.reset_prefix_cache()
    salt = effective_cache_salt(header_salt, body.get("cache_salt"))
    engine.add_request("r", ids, SamplingParams(max_tokens=1), cache_salt=salt)
    while engine.has_unfinished_requests():
        engine.step()
    return ids, set(engine.block_manager.cached_keys())


@pytest.mark.parametrize(("kind", "path", "body", "header_salt"), BODIES)
def test_router_keys_equal_the_engines(engine, kind, path, body, header_salt):
    router = RouterTokenizer(tokenizer_description(engine))
    prompt = router.prompt_text(path, body)
    assert prompt is not None
    ids = router.encode(prompt)
    engine_ids, cached = _engine_keys(engine, kind, body, header_salt)
    assert ids == engine_ids
    keys = router.block_keys(ids, router.salt(header_salt, prompt))
    assert len(keys) == len(ids) // 16 >= 2
    assert set(keys) <= cached


def test_salts_keep_keys_apart(engine):
    router = RouterTokenizer(tokenizer_description(engine))
    prompt = router.prompt_text(COMPLETIONS_PATH, {"prompt": LONG})
    ids = router.encode(prompt)
    variants = [(None, None), ("a", None), ("b", None), ("a", "x"), (None, "a")]
    first = {
        router.block_keys(ids, router.salt(h, dataclasses.replace(prompt, cache_salt=b)))[0]
        for h, b in variants
    }
    assert len(first) == len(variants)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (CHAT_PATH, {"messages": []}),
        (CHAT_PATH, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
        (CHAT_PATH, {**CHAT, "chat_template_kwargs": {"messages": []}}),
        (CHAT_PATH, {**CHAT, "tools": "get_weather"}),
        (CHAT_PATH, {**CHAT, "tools": [{"type": "retrieval"}]}),
        (CHAT_PATH, {**CHAT, "tools": [{"type": "function", "function": {}}]}),
        (CHAT_PATH, {"messages": [{"role": "tool", "content": "x"}]}),
        (CHAT_PATH, {"messages": [{"role": "user", "tool_calls": TOOL_HISTORY[4]["tool_calls"]}]}),
        (CHAT_PATH, {"messages": [{"role": "assistant", "tool_calls": [{"id": "x"}]}]}),
        (COMPLETIONS_PATH, {"prompt": 3}),
        (COMPLETIONS_PATH, {"prompt": "x", "cache_salt": ""}),
        ("/tokenize", {"prompt": "x"}),
    ],
)
def test_unreadable_bodies_give_no_prompt(engine, path, body):
    assert RouterTokenizer(tokenizer_description(engine)).prompt_text(path, body) is None


def test_a_bad_description_is_refused():
    with pytest.raises(RouterError):
        RouterTokenizer({"tokenizer_id": "x", "block_size": 16, "tokenizer_json": "{"})


@pytest.mark.asyncio
async def test_the_daemon_serves_its_tokenizer_to_key_holders(aiohttp_client, tmp_path) -> None:
    checkpoint = build_checkpoint(tmp_path)
    config = daemon_config(checkpoint, api_key="k")
    client = await start(aiohttp_client, config, load_engine(checkpoint))
    assert (await client.get("/v1/tokenizer")).status == 401
    resp = await client.get("/v1/tokenizer", headers={"Authorization": "Bearer k"})
    assert resp.status == 200
    router = RouterTokenizer(await resp.json())
    state = await (await client.get("/v1/state")).json()
    assert router.tokenizer_id == state["tokenizer_id"]
    assert router.block_size == config.block_size
    assert router.encode(router.prompt_text(COMPLETIONS_PATH, {"prompt": "hello"}))


# Templates that render tools themselves (transformers' way): one source, and a checkpoint's
# named list whose ``tool_use`` entry is taken only when tools are given.
NATIVE = (
    "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {% if m.tool_calls %}"
    "{% for c in m.tool_calls %}{{ c.function.name }}({{ c.function.arguments | tojson }}){% endfor %}"
    "{% else %}{{ m.content }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
PLAIN = "{% for m in messages %}{{ m.role }}> {{ m.content }}\n{% endfor %}"


@pytest.mark.parametrize("template", [NATIVE, {"default": PLAIN, "tool_use": NATIVE}])
@pytest.mark.parametrize("body", TOOL_BODIES)
def test_tool_requests_render_as_the_daemon_renders_them(engine, template, body):
    tok = copy.copy(engine.tokenizer)
    tok.chat_template = template
    info = ModelInfo("m", tok, tok.vocab_size, 4096, 4096)
    daemon_ids = parse_request("chat", {**body, "max_tokens": 1}, info, None).prompts[0]
    router = RouterTokenizer({**tokenizer_description(engine), "chat_template": template})
    prompt = router.prompt_text(CHAT_PATH, body)
    assert prompt is not None
    assert router.encode(prompt) == daemon_ids
    text = tok.decode(daemon_ids, skip_special_tokens=False)
    assert ("TOOLS " in text) == bool(body.get("tools"))


def test_a_conversations_next_turn_reuses_its_encoded_pieces(engine):
    """The second turn's history comes from the piece cache, and its ids are still the
    engine's."""
    router = RouterTokenizer(tokenizer_description(engine))
    first = router.prompt_text(CHAT_PATH, CHAT)
    router.encode(first, salt="tenant-a")
    turn = {"messages": [*CHAT["messages"], {"role": "assistant", "content": "ok " + LONG},
                         {"role": "user", "content": "one more"}]}  # fmt: skip
    second = router.prompt_text(CHAT_PATH, turn)
    ids, cached = router.encode_counted(second, salt="tenant-a")
    assert ids == _engine_keys(engine, "chat", turn, "tenant-a")[0]
    if router.segments.segmenting:
        assert cached > len(ids) // 2
    # Another tenant's request finds nothing of it.
    assert router.encode_counted(second, salt="tenant-b") == (ids, 0)
