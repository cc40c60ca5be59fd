"""Drive an :class:`LLMEngine` from asyncio without ever blocking the event loop.

The engine lives in one dedicated thread that alternates between running queued commands
(add, abort, KV import/export: anything that touches engine state) and ``step()``. Outputs
are handed to the event loop with ``call_soon_threadsafe`` and fanned out to per-request
queues. Torch releases the GIL in its kernels, so the loop stays responsive while a step runs.

:meth:`AsyncEngine.launch` builds the engine in that same thread, so loading and every step
share one OpenMP thread team. Each thread that runs a parallel torch op gets a team of its own,
and libgomp counts the workers of all of them: once they outnumber the cores it stops spinning
between parallel regions, and every op then waits for sleeping workers to wake. A model loaded
on another thread (``asyncio.to_thread``) made prefill steps 1.5-2x slower on 2 cores.

The same team suffers when other work takes a core: each parallel region ends at a barrier
that waits for the worker the OS has not scheduled, so a step on 2 threads of 2 busy cores
ran many times slower than on 1. :meth:`AsyncEngine.lend_cores` steps on one thread while
the API process does heavy work of its own (reading and checking a huge request body).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from collections.abc import Sequence as Seq
from concurrent.futures import Future
from typing import Any, TypeVar

from edgeinfer.daemon.engine.errors import EngineError
from edgeinfer.daemon.engine.llm_engine import LLMEngine
from edgeinfer.daemon.engine.model_runner import ModelRunner
from edgeinfer.daemon.engine.outputs import RequestOutput
from edgeinfer.daemon.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")

_IDLE_WAIT_S = 0.05
_abandoned_builds: set[threading.Thread] = set()  # see AsyncEngine.abandoned_builds


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[Callable[[LLMEngine], Any], Future[Any]]] = (
            queue.SimpleQueue()
        )
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self.fatal_error: BaseException | None = None
        # Called in the engine thread after every step with (seconds, prompt tokens computed,
        # tokens decoded: generated past each request's first): how the daemon measures its
        # prefill and decode rates.
        self.on_step: Callable[[float, int, int], None] | None = None
        # Called in the engine thread after a step that changed the prefix cache, with the
        # block manager's changes (see BlockManager.take_changes): the daemon's kv_events.
        self.on_kv_events: Callable[[dict[bytes, bool]], None] | None = None
        self._lent = 0  # lend_cores blocks running now
        # Whether the step running now took every thread, and who waits for its end
        # (lend_cores): both with _lent under _lend_lock, which orders them with the thread.
        self._lend_lock = threading.Lock()
        self._uncapped_step = False
        self._step_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    # ---- lifecycle ------------------------------------------------------------------
    @classmethod
    async def launch(cls, build: Callable[[], LLMEngine]) -> AsyncEngine:
        """Build an engine with ``build()`` in a new engine thread and start stepping it there
        (see the module docstring for why one thread does both); raises what ``build`` does.

        Cancelling the caller abandons the build: it runs on in its thread (a thread inside
        torch cannot be interrupted) and the engine it returns stops at once. Until then the
        thread is listed by :meth:`abandoned_builds`.
        """
        loop = asyncio.get_running_loop()
        ready: Future[AsyncEngine] = Future()
        abandoned = threading.Event()  # the caller was cancelled: nobody will stop the engine

        def main() -> None:
            if not ready.set_running_or_notify_cancel():
                return
            try:
                engine = cls(build())
            except BaseException as exc:
                ready.set_exception(exc)
                return
            engine._loop = loop
            engine._thread = threading.current_thread()
            ready.set_result(engine)
            if not abandoned.is_set():
                engine._run()

        thread = threading.Thread(target=main, name="edgeinfer-engine", daemon=True)
        thread.start()
        try:
            return await asyncio.wrap_future(ready)
        except asyncio.CancelledError:
            # Whatever the thread builds stops at once (set before the check below, so the
            # thread either sees the flag or its engine is stopped here).
            abandoned.set()
            _abandoned_builds.add(thread)
            if ready.done() and not ready.cancelled() and ready.exception() is None:
                orphan = ready.result()
                orphan._stopping = True
                orphan._wake.set()
            raise

    @staticmethod
    def abandoned_builds() -> list[threading.Thread]:
        """Threads of cancelled :meth:`launch` calls that still run (building, or stopping
        what they built). The interpreter must not finalize while one is inside torch: its
        exit tears down torch and OpenMP under the thread (SIGSEGV, or SIGABRT when the thread
        is unwound through C++ frames)."""
        _abandoned_builds.difference_update([t for t in _abandoned_builds if not t.is_alive()])
        return list(_abandoned_builds)

    def start(self) -> None:
        """Start stepping an engine built elsewhere (tests, tools); a server uses
        :meth:`launch`."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="edgeinfer-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @contextlib.asynccontextmanager
    async def lend_cores(self) -> AsyncIterator[None]:
        """The block runs while the engine steps on one torch thread (a CPU engine in this
        process; others are unaffected): its own CPU work then delays no step's thread team.
        Entering waits for the end of a step already running on every thread (one step at
        most): that step's team would otherwise wait at each barrier for the core the block
        took, and it did, measured: steps of ~1 ms took 35-40 ms while a 16 MiB body was
        read. Blocks may nest and overlap; the last one to end restores the threads."""
        loop = asyncio.get_running_loop()
        with self._lend_lock:
            self._lent += 1
            waiter = None
            if self._uncapped_step:
                waiter = loop.create_future()
                self._step_waiters.append((loop, waiter))
        try:
            if waiter is not None:
                await waiter
            yield
        finally:
            with self._lend_lock:
                self._lent -= 1

    # ---- commands -------------------------------------------------------------------
    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` in the engine thread between two steps and await its result."""
        if self.fatal_error is not None or not self.is_alive:
            raise EngineError("the engine is not running") from self.fatal_error
        fut: Future[T] = Future()
        self._commands.put((fn, fut))
        self._wake.set()
        return await asyncio.wrap_future(fut)

    def open_stream(self, request_id: str) -> asyncio.Queue[RequestOutput | BaseException]:
        """Register where outputs of ``request_id`` go (before the request is added)."""
        if request_id in self._streams:
            raise EngineError(f"request id {request_id!r} is already streaming")
        q: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = q
        return q

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def abort_all(self, exc: EngineError) -> int:
        """End every open stream with ``exc`` (call on the event loop); returns how many.

        Shutdown uses it once the drain timeout passed: each handler then answers with a
        clean error (an SSE error event, or a 500 body) instead of a cut connection, and
        closing its iterator aborts the request in the engine as usual.
        """
        for q in self._streams.values():
            q.put_nowait(exc)
        return len(self._streams)

    async def generate(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: SamplingParams,
        *,
        prefill_only: bool = False,
        cache_salt: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Add a request and yield its outputs; closing the iterator early aborts it."""
        q = self.open_stream(request_id)
        finished = False
        try:
            await self.call(
                lambda e: e.add_request(
                    request_id, prompt, params, prefill_only=prefill_only, cache_salt=cache_salt
                )
            )
            async for out in self.iterate(q):
                finished = out.finished
                yield out
        finally:
            self.close_stream(request_id)
            if not finished and self.is_alive:
                await self.call(lambda e: e.abort_request(request_id))

    @staticmethod
    async def iterate(
        q: asyncio.Queue[RequestOutput | BaseException],
    ) -> AsyncIterator[RequestOutput]:
        while True:
            item = await q.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return

    # ---- engine thread --------------------------------------------------------------
    def _run(self) -> None:
        try:
            if isinstance(self.engine.runner, ModelRunner):
                self.engine.runner.bind_threads()  # this thread steps: its team, bound
            while not self._stopping:
                self.engine.check_health()  # a dead worker rank fails the engine, even idle
                self._run_commands()
                if self.engine.has_unfinished_requests():
                    self._step()
                else:
                    self._wake.wait(_IDLE_WAIT_S)
                    self._wake.clear()
        except BaseException as exc:  # a bug in a step: fail every request, loudly
            log.exception("engine thread crashed")
            self.fatal_error = exc
            self._fail_all(exc)
        finally:
            self._drain_commands(EngineError("the engine stopped"))

    def _step(self) -> None:
        e = self.engine
        with self._lend_lock:
            capped = self._lent > 0
            self._uncapped_step = not capped and isinstance(e.runner, ModelRunner)
        if isinstance(e.runner, ModelRunner):
            e.runner.thread_cap = 1 if capped else None
        try:
            self._timed_step(e)
        finally:
            with self._lend_lock:
                self._uncapped_step = False
                waiters, self._step_waiters = self._step_waiters, []
            for loop, waiter in waiters:
                with contextlib.suppress(RuntimeError):  # a loop closed meanwhile
                    loop.call_soon_threadsafe(_resolve, waiter)

    def _timed_step(self, e: LLMEngine) -> None:
        prompt, decoded, start = e.prompt_tokens_computed, e.decode_tokens, time.perf_counter()
        outputs = e.step()
        if self.on_step is not None:
            self.on_step(
                time.perf_counter() - start,
                e.prompt_tokens_computed - prompt,
                e.decode_tokens - decoded,
            )
        if self.on_kv_events is not None:
            changes = e.block_manager.take_changes()
            if changes:
                self.on_kv_events(changes)
        if outputs:
            self._deliver(outputs)

    def _run_commands(self) -> None:
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(self.engine))
            except Exception as exc:
                fut.set_exception(exc)

    def _drain_commands(self, exc: BaseException) -> None:
        while True:
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                fut.set_exception(exc)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._fan_out, outputs)

    def _fan_out(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            q = self._streams.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    def _fail_all(self, exc: BaseException) -> None:
        if self._loop is None:
            return

        def fail() -> None:
            for q in self._streams.values():
                q.put_nowait(EngineError(f"engine failure: {exc}"))

        self._loop.call_soon_threadsafe(fail)


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():  # its lender may have been cancelled meanwhile
        waiter.set_result(None)
