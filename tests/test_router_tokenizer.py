"""The router's prompt ids and block keys equal the engine's, for every tiny architecture."""

from __future__ import annotations

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
BODIES = [
    ("chat", CHAT_PATH, CHAT, None),
    ("chat", CHAT_PATH, {**CHAT, "add_generation_prompt": False}, "tenant-a"),
    ("chat", CHAT_PATH, {**CHAT, "cache_salt": "mine"}, "tenant-a"),
    ("completion", COMPLETIONS_PATH, {"prompt": LONG}, None),
    ("completion", COMPLETIONS_PATH, {"prompt": LONG, "add_special_tokens": False}, "t"),
    ("completion", COMPLETIONS_PATH, {"prompt": LONG, "cache_salt": "x"}, None),
    ("completion", COMPLETIONS_PATH, {"prompt": list(range(5, 70))}, "t"),
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
    keys = router.block_keys(ids, header_salt, prompt.cache_salt)
    assert len(keys) == len(ids) // 16 >= 2
    assert set(keys) <= cached


def test_salts_keep_keys_apart(engine):
    router = RouterTokenizer(tokenizer_description(engine))
    ids = router.encode(router.prompt_text(COMPLETIONS_PATH, {"prompt": LONG}))
    variants = [(None, None), ("a", None), ("b", None), ("a", "x"), (None, "a")]
    first = {router.block_keys(ids, h, b)[0] for h, b in variants}
    assert len(first) == len(variants)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (CHAT_PATH, {"messages": []}),
        (CHAT_PATH, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
        (CHAT_PATH, {**CHAT, "chat_template_kwargs": {"messages": []}}),
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
