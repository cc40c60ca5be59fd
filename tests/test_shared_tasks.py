"""cancel_and_wait: stops a background task, never swallows the caller's own cancellation."""

from __future__ import annotations

import asyncio
import logging

import pytest

from edgeinfer.shared.tasks import cancel_and_wait

pytestmark = pytest.mark.asyncio


async def test_cancels_and_waits_for_a_running_task() -> None:
    cleaned = asyncio.Event()

    async def worker() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            cleaned.set()

    task = asyncio.create_task(worker())
    await asyncio.sleep(0)
    await cancel_and_wait(task)
    assert task.cancelled() and cleaned.is_set()
    await cancel_and_wait(None)
    await cancel_and_wait(task)  # already done: nothing to do, nothing raised


async def test_a_failed_task_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    async def boom() -> None:
        raise ValueError("broken pipe")

    task = asyncio.create_task(boom(), name="boom-task")
    await asyncio.sleep(0)
    with caplog.at_level(logging.WARNING):
        await cancel_and_wait(task)
    assert "boom-task" in caplog.text and "broken pipe" in caplog.text


async def test_the_callers_cancellation_propagates() -> None:
    stopping = asyncio.Event()

    async def slow_to_stop() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            stopping.set()
            await asyncio.sleep(3600)  # cleanup that outlasts the caller's patience

    background = asyncio.create_task(slow_to_stop())
    await asyncio.sleep(0)
    stopper = asyncio.create_task(cancel_and_wait(background))
    await stopping.wait()
    stopper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopper
    background.cancel()
    with pytest.raises(asyncio.CancelledError):
        await background
