"""Salted prefix caches (issue 16 §3): block keys per salt, unchanged tokens, preemption, and the
salt carried over the KV wire to the prefill daemon's cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgeinfer.daemon.api.cache_salt import effective_cache_salt
from edgeinfer.daemon.engine.block_manager import BlockManager, salt_key
from edgeinfer.daemon.engine.config import EngineConfig
from edgeinfer.daemon.engine.errors import InvalidRequestError
from edgeinfer.daemon.engine.llm_engine import LLMEngine
from edgeinfer.daemon.engine.sampler import SamplingState
from edgeinfer.daemon.engine.sampling_params import SamplingParams
from edgeinfer.daemon.engine.sequence import Sequence
from engine_helpers import make_checkpoint, random_prompts
from kv_transfer_helpers import GREEDY as GREEDY_KV
from kv_transfer_helpers import build_checkpoint as build_kv_checkpoint
from kv_transfer_helpers import kv_bytes, prompt_of, reference_tokens, running_pair

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("salt"), "LlamaForCausalLM")


def _seq(tokens: list[int], salt: str | None) -> Sequence:
    return Sequence("s", tokens, SamplingParams(), SamplingState(SamplingParams()), cache_salt=salt)


def test_every_block_key_depends_on_the_salt() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(3, 35))  # 8 full blocks
    chains = {}
    for salt in (None, "tenant-a", "tenant-b"):
        seq = _seq(tokens, salt)
        chains[salt] = bm._hashes(seq)
        bm.forget(seq)
    keys = [set(chain) for chain in chains.values()]
    assert all(len(k) == 8 for k in keys)
    assert not (keys[0] & keys[1]) and not (keys[0] & keys[2]) and not (keys[1] & keys[2])
    # A salt's root key is no block key of any chain (its own hash domain).
    roots = {salt_key("tenant-a"), salt_key("tenant-b")}
    assert not roots & set().union(*keys)
    assert salt_key(None) is None


def test_salts_share_blocks_only_when_equal_and_never_change_tokens(ckpt: Path) -> None:
    prefix = random_prompts(1, 512, 64, 64, seed=21)[0]  # 4 whole blocks
    prompt = prefix + [7, 8, 9]
    cold = LLMEngine(EngineConfig(model=str(ckpt), enable_prefix_caching=False))
    want = cold.generate([prompt], GREEDY)[0].token_ids
    engine = LLMEngine(EngineConfig(model=str(ckpt)))

    def run(salt: str | None) -> int:
        out = engine.generate([prompt], GREEDY, cache_salt=salt)[0]
        assert out.token_ids == want, f"salt {salt!r} changed the tokens"
        return out.num_cached_tokens

    assert run("a") == 0
    assert run("b") == 0  # tenant b cannot reuse (nor see) tenant a's blocks
    assert run(None) == 0  # nor can an unsalted request
    assert run("a") == 64 and run("b") == 64 and run(None) == 64  # each within its own salt
    assert engine.cached_prefix_tokens(prompt, cache_salt="a") == 64
    assert engine.cached_prefix_tokens(prompt, cache_salt="c") == 0
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("empty-salt", prompt, GREEDY, cache_salt="")
    assert err.value.param == "cache_salt"


def test_preempted_request_keeps_its_salt_and_its_cached_count(ckpt: Path) -> None:
    # Two requests outgrow a 12-block pool while decoding: the later one (salted) is preempted,
    # recomputed, and finds its own earlier blocks under its salt.
    prompts = random_prompts(2, 512, 64, 64, seed=33)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    want = [c.token_ids for c in LLMEngine(EngineConfig(model=str(ckpt))).generate(prompts, params)]
    engine = LLMEngine(EngineConfig(model=str(ckpt), num_kv_blocks=12))
    engine.add_request("plain", prompts[0], params)
    engine.add_request("salted", prompts[1], params, cache_salt="tenant-a")
    tokens: dict[str, list[int]] = {"plain": [], "salted": []}
    cached: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            cached[out.request_id] = out.num_cached_tokens
    stats = engine.stats()
    assert stats.num_preemptions > 0, "the small pool was meant to force preemption"
    assert [tokens["plain"], tokens["salted"]] == want
    # The readmission hit the salted blocks it computed itself before it was preempted ...
    assert stats.prefix_cache_hits > 0
    # ... which were computed for this request, so they are not reported as cached.
    assert cached == {"plain": 0, "salted": 0}
    assert engine.cached_prefix_tokens(prompts[1]) == 0


def test_effective_salt_is_unambiguous() -> None:
    assert effective_cache_salt(None, None) is None
    assert effective_cache_salt("", None) is None  # an empty header names no tenant
    salts = [
        effective_cache_salt(h, b)
        for h, b in [("a", None), (None, "a"), ("a", "b"), ("ab", None), ("a", "ba"), ("ab", "a")]
    ]
    assert len(set(salts)) == len(salts)
    assert effective_cache_salt("a", "b") == effective_cache_salt("a", "b")
    assert all(s is not None and len(s) == 32 for s in salts)


# ---- disaggregated: the salt crosses the KV wire ---------------------------------------


@pytest.fixture(scope="module")
def kv_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_kv_checkpoint(tmp_path_factory.mktemp("salt_kv"))


@pytest.mark.asyncio
async def test_remote_prefill_applies_the_salt_on_both_sides(kv_ckpt: Path) -> None:
    prompt = prompt_of(100, offset=4321)  # 6 whole blocks + 4 tokens
    want = reference_tokens(kv_ckpt, [prompt])[0]
    async with running_pair(kv_ckpt) as pair:

        async def remote(rid: str, salt: str | None) -> tuple[list[int], int]:
            stream = pair.decode.open_stream(rid)
            try:
                first = await pair.client.prefill(
                    rid, prompt, GREEDY_KV, pair.endpoint, cache_salt=salt
                )
                tokens, cached = list(first.new_token_ids), first.num_cached_tokens
                async for out in pair.decode.iterate(stream):
                    tokens.extend(out.new_token_ids)
                    cached = out.num_cached_tokens
                return tokens, cached
            finally:
                pair.decode.close_stream(rid)

        assert await remote("a1", "tenant-a") == (want, 0)
        assert pair.server.stats.kv_bytes_sent == kv_bytes(7)
        # Tenant b: neither cache hits, every block crosses the wire again.
        assert await remote("b1", "tenant-b") == (want, 0)
        assert pair.server.stats.kv_bytes_sent == kv_bytes(14)
        # Tenant a again: the decode side holds 6 blocks (not sent), the prefill side's cache
        # held them too, so 96 prompt tokens were computed nowhere for this request.
        assert await remote("a2", "tenant-a") == (want, 96)
        assert pair.server.stats.kv_bytes_sent == kv_bytes(15)
        prefill_engine = pair.prefill.engine
        assert prefill_engine.cached_prefix_tokens(prompt, cache_salt="tenant-a") == 96
        assert prefill_engine.cached_prefix_tokens(prompt) == 0
        assert pair.prefill_blocks_used() == 0 and pair.decode_blocks_used() == 0
