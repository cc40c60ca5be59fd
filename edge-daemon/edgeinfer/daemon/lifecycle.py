"""The daemon's life under a service manager: loading progress, the drain on SIGTERM, and the
exit when a stop comes while the model loads.

``main.serve`` owns the order (listen, load, READY=1, serve, drain, stop); the steps with more
than a line to them live here so that it stays readable. Notifications go to systemd through
:class:`~edgeinfer.shared.sdnotify.Notifier`, a no-op outside systemd.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import NoReturn

from edgeinfer.daemon.config import DaemonConfig
from edgeinfer.daemon.engine.errors import EngineError
from edgeinfer.daemon.state import ServingState
from edgeinfer.shared.sdnotify import Notifier

log = logging.getLogger("edgeinfer.daemon")

# How often STATUS= repeats while a model loads: `systemctl status` then shows it is alive.
STATUS_EVERY_S = 2.0
# After the drain timeout, how long aborted handlers get to write their error and finish.
ABORT_GRACE_S = 2.0


async def wait_loaded(
    state: ServingState, stop: asyncio.Event, notifier: Notifier, config: DaemonConfig
) -> None:
    """Return once loading succeeded or failed, or a stop signal came; report progress."""
    what = f"loading model {config.model_name}"
    notifier.status(what)
    start = time.monotonic()
    while not (state.settled.is_set() or stop.is_set()):
        await first_of(state.settled, stop, timeout=STATUS_EVERY_S)
        if not state.settled.is_set():
            notifier.status(f"{what} ({time.monotonic() - start:.0f} s)")


async def drain(state: ServingState, config: DaemonConfig, notifier: Notifier) -> None:
    """Refuse new work, let in-flight requests finish for up to ``drain_timeout_s``, then
    end what remains with an error its client can read (an SSE error event or a 500)."""
    state.drain()
    if state.plane is not None:
        await state.plane.set_draining(True)
    notifier.stopping(f"draining: {state.in_flight} requests in flight")
    log.info("stopping: waiting for %d in-flight requests", state.in_flight)
    if await state.wait_idle(config.drain_timeout_s):
        return
    reason = f"the daemon is shutting down: its {config.drain_timeout_s:g} s drain timeout passed"
    aborted = state.engine.abort_all(EngineError(reason)) if state.engine is not None else 0
    log.warning("drain timeout: aborting %d requests", aborted)
    notifier.status(f"stopping: aborted {aborted} requests after the drain timeout")
    if not await state.wait_idle(ABORT_GRACE_S):
        log.warning("%d requests still open after the abort: closing them", state.in_flight)


async def first_of(*events: asyncio.Event, timeout: float | None = None) -> None:
    """Wait until any of ``events`` is set, or ``timeout`` seconds passed."""
    waiters = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()


def exit_now(code: int) -> NoReturn:
    """End the process without finalizing the interpreter, for a stop while the model loads.

    The load runs in a thread that cannot be interrupted inside torch, and finalizing the
    interpreter under it kills the process with a signal (SIGSEGV as torch's and OpenMP's
    globals are torn down, SIGABRT "terminate called without an active exception" when the
    thread is unwound through C++ frames). Waiting for it is not a prompt stop: loading takes
    seconds to minutes. Nothing needs the finalization either: no request was served, the HTTP
    server is closed, and what a load writes (the converted built-in model, compiled kernels) is
    built aside and renamed into place, under a lock the kernel drops with the process. What
    is left is done here: the load's child processes (a compiler, pip, parallel ranks' fork
    server) get SIGTERM, and the logs are flushed.
    """
    for pid in _child_processes():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def _child_processes() -> list[int]:
    """Pids of this process's children (Linux lists them per thread that started them)."""
    pids: list[int] = []
    for listing in Path("/proc/self/task").glob("*/children"):
        with contextlib.suppress(OSError):
            pids += [int(pid) for pid in listing.read_text().split()]
    return pids
