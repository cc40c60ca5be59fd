"""Disaggregation across layouts: KV pages re-split by heads between a TP=2 and a TP=1 engine,
over the real ZeroMQ prefill server and decode client (issue: parallel)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest

from edgeinfer.daemon.engine.async_engine import AsyncEngine
from edgeinfer.daemon.engine.llm_engine import LLMEngine
from edgeinfer.daemon.engine.parallel.executor import ParallelExecutor
from edgeinfer.daemon.kv_transfer.decode_client import RemotePrefillClient
from edgeinfer.daemon.kv_transfer.prefill_server import PrefillServer
from edgeinfer.daemon.kv_transfer.stats import TransferStats
from engine_helpers import make_checkpoint
from kv_transfer_helpers import ANY_PORT, Pair, remote_generate
from parallel_helpers import GREEDY, PROMPTS, engine_config, tokens

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    ckpt = make_checkpoint(tmp_path_factory.mktemp("disagg"), "LlamaForCausalLM")
    built = {tp: LLMEngine(engine_config(ckpt, tp)) for tp in (1, 2)}
    want = tokens(LLMEngine(engine_config(ckpt)))  # a third engine doing everything itself
    yield built, want
    runner = built[2].runner
    if isinstance(runner, ParallelExecutor):
        runner.close()


@contextlib.asynccontextmanager
async def pair(prefill: LLMEngine, decode: LLMEngine) -> AsyncIterator[Pair]:
    engines = AsyncEngine(prefill), AsyncEngine(decode)
    for e in engines:
        e.start()
    server = PrefillServer(engines[0], ANY_PORT, stats=TransferStats(), chunk_bytes=1 << 12)
    await server.start()
    client = RemotePrefillClient(engines[1], stats=TransferStats(), timeout_s=30)
    try:
        yield Pair(engines[0], engines[1], server, client)
    finally:
        await client.close()
        await server.stop(drain=False)
        for e in engines:
            await e.stop()


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)])
async def test_remote_prefill_across_layouts(engines, prefill_tp: int, decode_tp: int) -> None:
    built, want = engines
    async with pair(built[prefill_tp], built[decode_tp]) as p:
        for i, prompt in enumerate(PROMPTS):
            got = await remote_generate(p, f"x{prefill_tp}-{i}", prompt, GREEDY)
            assert got == want[i], f"prompt {i} ({len(prompt)} tokens)"
        assert p.server.stats.transfers_ok == len(PROMPTS)
        assert p.prefill_blocks_used() == 0
