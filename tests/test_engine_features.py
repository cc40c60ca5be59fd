"""Engine behaviour beyond HF parity: prefix caching, stage split, sampling, stops, errors."""

from __future__ import annotations

import asyncio

import pytest

from edgeinfer.daemon.engine.async_engine import AsyncEngine
from edgeinfer.daemon.engine.config import EngineConfig
from edgeinfer.daemon.engine.errors import InvalidRequestError
from edgeinfer.daemon.engine.llm_engine import LLMEngine
from edgeinfer.daemon.engine.sampling_params import SamplingParams
from engine_helpers import make_checkpoint, random_prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("feat"), "LlamaForCausalLM")


@pytest.fixture
def engine(ckpt):
    return LLMEngine(EngineConfig(model=str(ckpt), max_model_len=1024))


def test_prefix_cache_hit_reuses_blocks_and_keeps_tokens(ckpt, engine):
    prefix = random_prompts(1, 512, 160, 160, seed=3)[0]
    prompts = [prefix + [5, 6, 7], prefix + [8, 9], prefix + [10]]
    cold = LLMEngine(EngineConfig(model=str(ckpt), enable_prefix_caching=False))
    want = [c.token_ids for c in cold.generate(prompts, GREEDY)]

    first = engine.generate(prompts[:1], GREEDY)[0]
    hits_before = engine.stats().prefix_cache_hits
    rest = engine.generate(prompts[1:], GREEDY)
    assert [first.token_ids] + [c.token_ids for c in rest] == want
    assert all(c.num_cached_tokens == 160 for c in rest)
    assert engine.stats().prefix_cache_hits - hits_before == 2 * 10


# Seeded sampling too: the decode side skips the draw the prefill side made for the first token.
@pytest.mark.parametrize(
    "params",
    [GREEDY, SamplingParams(max_tokens=12, temperature=0.8, seed=77)],
    ids=["greedy", "seeded"],
)
def test_prefill_export_import_decode_matches_single_engine(ckpt, engine, params):
    prompts = random_prompts(4, 512, 1, 90, seed=11)
    want = [c.token_ids for c in engine.generate(prompts, params)]

    prefill = LLMEngine(EngineConfig(model=str(ckpt), max_num_batched_tokens=32))
    decode = LLMEngine(EngineConfig(model=str(ckpt)))
    bs = prefill.config.block_size
    got = []
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        prefill.add_request(rid, prompt, params, prefill_only=True)
        cached = decode.reserve_remote(rid, prompt, params)
        sent, first = cached // bs, None
        while first is None:
            for out in prefill.step():
                # Ship each block as soon as the prefill side reports it complete.
                pages = prefill.export_kv(rid, sent, out.kv_blocks_ready)
                for layer, (k, v) in enumerate(pages):
                    if k.shape[0]:
                        decode.import_kv(rid, sent, layer, k, v)
                sent = out.kv_blocks_ready
                if out.finished:
                    assert out.finish_reason == "prefilled"
                    first = out.new_token_ids[0]
        prefill.release(rid)
        tokens = list(decode.commit_remote(rid, first).new_token_ids)
        while decode.has_unfinished_requests():
            for out in decode.step():
                tokens.extend(out.new_token_ids)
        got.append(tokens)
    assert got == want
    assert prefill.stats().kv_blocks_used == 0 or prefill.config.enable_prefix_caching
    assert prefill.stats().num_prefilled_held == 0


def test_seeded_sampling_is_reproducible(engine):
    prompts = random_prompts(3, 512, 5, 40, seed=5)
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234)
    alone = engine.generate([prompts[0]], seeded)[0].token_ids
    mixed = engine.generate(prompts, [seeded, GREEDY, SamplingParams(max_tokens=8, seed=9)])
    assert mixed[0].token_ids == alone
    other = engine.generate([prompts[0]], SamplingParams(max_tokens=16, temperature=0.9, seed=1))
    assert other[0].token_ids != alone


def test_stop_strings_cut_exactly(engine):
    prompt = "hello world"
    full = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))[0]
    text = full.text
    if len(text) < 6:
        pytest.skip("the random model emitted too little text for a stop string")
    stop = text[3:6]
    cut = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, stop=[stop]))
    assert cut[0].text == text[: text.index(stop)]
    assert cut[0].finish_reason == "stop"
    kept = engine.generate(
        [prompt],
        SamplingParams(
            max_tokens=24, temperature=0.0, stop=[stop], include_stop_str_in_output=True
        ),
    )
    assert kept[0].text == text[: text.index(stop) + len(stop)]


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_k": -5}, "top_k"),
        ({"logprobs": 99}, "logprobs"),
    ],
)
def test_bad_sampling_params_raise(kwargs, param):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param
    assert param in str(err.value)


def test_overlong_prompt_and_budget_are_rejected(engine):
    with pytest.raises(InvalidRequestError, match="context"):
        engine.add_request("long", [5] * 1024, GREEDY)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        engine.add_request("budget", [5] * 1000, SamplingParams(max_tokens=100))
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("empty", [], GREEDY)
    assert engine.stats().kv_blocks_used == 0


def test_abort_frees_blocks(engine):
    engine.add_request("a", random_prompts(1, 512, 100, 100)[0], SamplingParams(max_tokens=50))
    engine.step()
    assert engine.stats().kv_blocks_used > 0
    out = engine.abort_request("a")
    assert out is not None and out.finish_reason == "abort"
    assert engine.stats().num_running == 0
    engine.block_manager.reset_prefix_cache()
    assert engine.stats().kv_blocks_used == 0


def test_async_engine_streams_and_aborts(engine):
    async def main() -> tuple[list[int], int]:
        runner = AsyncEngine(engine)
        runner.start()
        try:
            tokens: list[int] = []
            async for out in runner.generate("s1", [5, 6, 7], GREEDY):
                tokens.extend(out.new_token_ids)
            gen = runner.generate("s2", [5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True))
            await anext(gen)
            await gen.aclose()  # a client that goes away mid-stream
            running = await runner.call(lambda e: e.stats().num_running)
            return tokens, running
        finally:
            await runner.stop()

    tokens, running = asyncio.run(main())
    assert tokens == engine.generate([[5, 6, 7]], GREEDY)[0].token_ids
    assert running == 0


def test_steps_that_decode_cap_their_prefill_tokens(ckpt):
    # Two streams decode while three long prompts arrive: each step that decodes prefills at
    # most 128 prompt tokens, so no decoding stream waits behind a long step; the answers are
    # the uncapped engine's.
    prompts = random_prompts(5, 512, min_len=300, max_len=300, seed=11)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs, largest = [], []
    for cap in (128, 0):
        engine = LLMEngine(EngineConfig(model=str(ckpt), max_prefill_tokens_with_decodes=cap))
        steps: list[tuple[int, int]] = []  # (decode tokens, prefill tokens) of each step
        schedule = engine.scheduler.schedule

        def recording(schedule=schedule, steps=steps):
            batch = schedule()
            steps.append(
                (
                    sum(1 for _, n in batch.entries if n == 1),
                    sum(n for _, n in batch.entries if n > 1),
                )
            )
            return batch

        engine.scheduler.schedule = recording
        for i in range(2):
            engine.add_request(f"r{i}", prompts[i], params)
        engine.step()  # both prompts prefilled: the next steps decode them
        for i in range(2, 5):
            engine.add_request(f"r{i}", prompts[i], params)
        done: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                done.setdefault(out.request_id, []).extend(out.new_token_ids)
        outputs.append(done)
        largest.append(max(p for d, p in steps if d))
    assert largest[0] == 128  # capped beside decodes
    assert largest[1] > 128  # without the cap, the waiting prompts share one step
    assert outputs[0] == outputs[1]


def test_decode_tokens_leave_out_each_requests_first(engine):
    # The daemon's decode rate (heartbeat decode_tokens_per_s) is decode tokens over the steps
    # that made them: a request's first token ends its prefill, it is no inter-token gap.
    before = engine.generation_tokens, engine.decode_tokens
    done = engine.generate(random_prompts(3, 512, 20, 40, seed=5), GREEDY)
    assert sum(len(c.token_ids) for c in done) == 3 * 12
    assert engine.generation_tokens - before[0] == 3 * 12
    assert engine.decode_tokens - before[1] == 3 * 11
