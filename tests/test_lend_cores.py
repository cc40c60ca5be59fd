"""Huge request bodies are taken in one at a time, and the engine steps on one thread meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import torch

from daemon_helpers import NUM_KV_BLOCKS, build_checkpoint
from edgeinfer.daemon.api.request_body import LARGE_BODY_BYTES
from edgeinfer.daemon.api.tokenize_pool import TokenizePool
from edgeinfer.daemon.engine.async_engine import AsyncEngine
from edgeinfer.daemon.engine.config import EngineConfig
from edgeinfer.daemon.engine.llm_engine import LLMEngine
from edgeinfer.daemon.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    checkpoint = build_checkpoint(tmp_path_factory.mktemp("lend_cores"))
    config = EngineConfig(
        model=str(checkpoint), num_kv_blocks=NUM_KV_BLOCKS, device="cpu", num_threads=2
    )
    return LLMEngine(config)


def test_steps_run_on_one_thread_while_cores_are_lent(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    async def main() -> tuple[list[int], list[int], list[int]]:
        runner = AsyncEngine(engine)
        seen: list[int] = []
        # Called in the engine thread after each step: the threads that step ran with.
        runner.on_step = lambda *_: seen.append(torch.get_num_threads())
        runner.start()

        async def generate(request_id: str) -> list[int]:
            async for _ in runner.generate(request_id, [5, 6, 7], params):
                pass
            steps = list(seen)
            seen.clear()
            return steps

        try:
            async with runner.lend_cores():
                async with runner.lend_cores():
                    nested = await generate("nested")
                outer = await generate("outer")  # the outer block still lends
            return nested, outer, await generate("after")
        finally:
            await runner.stop()

    nested, outer, after = asyncio.run(main())
    assert nested and set(nested) == {1}
    assert outer and set(outer) == {1}
    assert after and set(after) == {2}


def test_lending_waits_out_a_step_already_running_on_every_thread(engine: LLMEngine) -> None:
    """From the moment the block starts, no step runs on two threads: not even the one that
    was running when it asked."""
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)

    async def main() -> tuple[list[int], int, int]:
        runner = AsyncEngine(engine)
        seen: list[int] = []
        runner.on_step = lambda *_: seen.append(torch.get_num_threads())
        runner.start()
        try:
            stream = runner.generate("long", list(range(5, 200)), params)
            await anext(stream)  # prefilled: decode steps on two threads from here
            async with runner.lend_cores():
                entered = len(seen)
                while len(seen) < entered + 8:  # steps the block lives through
                    await anext(stream)
                left = len(seen)
            async for _ in stream:
                pass
            return seen, entered, left
        finally:
            await runner.stop()

    seen, entered, left = asyncio.run(main())
    assert 2 in seen[:entered]
    # Every step that ran while the block did: one thread (steps outlive the block's last
    # check by at most the one running as it ends).
    assert set(seen[entered : left - 1]) == {1}


def test_large_bodies_are_admitted_one_at_a_time_and_lend_cores() -> None:
    async def main() -> tuple[list[str], list[str]]:
        pool = TokenizePool(workers=1)
        events: list[str] = []
        lent: list[str] = []

        @contextlib.asynccontextmanager
        async def lend() -> AsyncIterator[None]:
            lent.append("lend")
            yield
            lent.append("back")

        first_in, release = asyncio.Event(), asyncio.Event()

        async def large(name: str, length: int | None) -> None:
            async with pool.admitted(length, lend):
                events.append(name)
                if name == "first":
                    first_in.set()
                    await release.wait()

        try:
            first = asyncio.create_task(large("first", LARGE_BODY_BYTES + 1))
            await first_in.wait()
            second = asyncio.create_task(large("unknown length", None))
            async with pool.admitted(100, lend):  # small: no slot, no lending
                events.append("small")
            snapshot = list(events)
            release.set()
            await asyncio.gather(first, second)
        finally:
            await pool.close()
        return snapshot, lent

    snapshot, lent = asyncio.run(main())
    # The second large body waited for the first one's slot; the small one did not.
    assert snapshot == ["first", "small"]
    assert lent == ["lend", "back", "lend", "back"]


def test_large_bodies_get_a_bounded_share_of_the_clock() -> None:
    """After a large body the slot stays held, idle, so admitting large bodies takes at most
    ``large_body_share`` of the wall clock (here 0.5: the idle time equals the busy time)."""

    async def main() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        pool = TokenizePool(workers=1, large_body_share=0.5)
        marks: dict[str, float] = {}

        async def large(name: str, busy_s: float) -> None:
            async with pool.admitted(LARGE_BODY_BYTES + 1):
                marks[f"{name} in"] = loop.time()
                await asyncio.sleep(busy_s)
                marks[f"{name} out"] = loop.time()

        try:
            first = asyncio.create_task(large("first", 0.05))
            await asyncio.sleep(0)  # the first takes the slot before the second asks
            await asyncio.gather(first, large("second", 0.0))
        finally:
            await pool.close()
        busy = marks["first out"] - marks["first in"]
        return busy, marks["second in"] - marks["first out"]

    busy, idle = asyncio.run(main())
    assert idle >= busy * 0.99


def test_large_body_share_is_checked() -> None:
    with pytest.raises(ValueError, match="large_body_share"):
        TokenizePool(large_body_share=0.0)
