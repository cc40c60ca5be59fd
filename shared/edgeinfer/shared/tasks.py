"""Owning background asyncio tasks: stop one and wait for it, without eating our own cancel."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger(__name__)


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` (if any) and wait until it has finished.

    The task's own ``CancelledError`` is the expected outcome and is absorbed, as is any
    exception it ended with, which is logged: the caller is shutting down and must go on
    releasing what it owns. If the *caller* is being cancelled while it waits, that cancellation propagates:
    a bare ``suppress(CancelledError)`` would swallow it and leave a shutdown half done.
    """
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
    except Exception:
        log.warning("background task %s had failed", task.get_name(), exc_info=True)
