"""Request parsing off the event loop: chat templates and tokenisation on a few threads.

The event loop writes every stream's tokens, so a prompt tokenised on it stalls them all: a
15 MiB prompt once held it for 19 s. Parsing runs here instead, on a small thread pool. The
tokenizers library releases the GIL while it encodes (``Tokenizer.encode`` goes through
``encode_batch``, which does), so the loop and the engine thread keep running; chat-template
rendering (jinja2) holds the GIL but is Python bytecode, which the interpreter hands over every
few milliseconds (measured: a 16 MiB message renders in ~6 ms). A JSON parser holds the GIL
throughout, so a thread would not shorten that stall: large bodies are decoded in another
process (``bodies``, :mod:`~edgeinfer.daemon.api.request_body`).

Admission is bounded too. A request with a large body (over :data:`LARGE_BODY_BYTES`, or of
unknown length) waits for one of ``max_large`` slots before its body is read, so a thousand
16 MiB posts wait on their connections rather than hold 16 GiB here; small requests never wait
for a slot (they may still queue briefly for a thread). One slot by default: reading, decoding
and checking a 16 MiB body is ~25 ms of CPU, most of it holding the GIL, so a second one at
the same time would only take a second core from the engine. While a large body is admitted
the engine steps on one thread (``lend``, :meth:`AsyncEngine.lend_cores`), leaving the other
cores to this work: measured on 2 cores, 4 clients posting 16 MiB prompts in a loop made the
streams' longest token gap 20x longer with the engine on 2 threads throughout.

Large bodies also get a bounded share of the daemon's time: after each one the slot stays held,
idle, long enough that admitting large bodies takes at most ``large_body_share`` of the wall
clock (0.25: each is followed by three times its own duration). A flood of huge posts then
costs the streams a fixed fraction of one core however fast it arrives; its posts wait on their
connections, unread, which costs the daemon nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from aiohttp import web

from edgeinfer.daemon.api.request_body import LARGE_BODY_BYTES, MAX_BODY_BYTES, BodyDecoder

T = TypeVar("T")

DEFAULT_WORKERS = 2
DEFAULT_MAX_LARGE = 1
DEFAULT_LARGE_BODY_SHARE = 0.25


class TokenizePool:
    def __init__(
        self,
        workers: int = DEFAULT_WORKERS,
        max_large: int = DEFAULT_MAX_LARGE,
        large_body_share: float = DEFAULT_LARGE_BODY_SHARE,
    ) -> None:
        if not 0 < large_body_share <= 1:
            raise ValueError(f"large_body_share must be in (0, 1], got {large_body_share}")
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="edgeinfer-tokenize")
        self.bodies = BodyDecoder(MAX_BODY_BYTES)
        self._large = asyncio.Semaphore(max_large)
        # Idle seconds the slot stays held per second spent admitting a large body.
        self._idle_per_busy = (1 - large_body_share) / large_body_share

    @contextlib.asynccontextmanager
    async def admitted(
        self,
        content_length: int | None,
        lend: Callable[[], contextlib.AbstractAsyncContextManager[None]] = contextlib.nullcontext,
    ) -> AsyncIterator[None]:
        """Hold a slot for the block (reading and parsing the body) when the body is large,
        and run the block inside ``lend()`` once the slot is held; then keep the slot, idle,
        for the block's duration times ``idle_per_busy`` (see the module docstring)."""
        if content_length is not None and content_length <= LARGE_BODY_BYTES:
            yield
            return
        loop = asyncio.get_running_loop()
        async with self._large:
            start = loop.time()
            try:
                async with lend():
                    yield
            finally:
                # A refused body cost as much as an accepted one, so both are paced.
                await asyncio.sleep((loop.time() - start) * self._idle_per_busy)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a worker thread. A cancelled caller stops waiting; the call itself
        runs to its end (parsing is bounded by the model's context, see ``prompt_length``)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))

    async def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        await self.bodies.close()


POOL_KEY = web.AppKey("tokenize_pool", TokenizePool)
