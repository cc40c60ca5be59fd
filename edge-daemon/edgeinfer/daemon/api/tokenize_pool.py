"""Request parsing off the event loop: chat templates and tokenisation on a few threads.

The event loop writes every stream's tokens, so a prompt tokenised on it stalls them all: a
15 MiB prompt once held it for 19 s. Parsing runs here instead, on a small thread pool. The
tokenizers library releases the GIL while it encodes (``Tokenizer.encode`` goes through
``encode_batch``, which does), so the loop and the engine thread keep running; chat-template
rendering (jinja2) holds the GIL but is Python bytecode, which the interpreter hands over every
few milliseconds (measured: a 16 MiB message renders in ~6 ms). Decoding the JSON body stays on
the loop: the parsers hold the GIL throughout, so a thread would not shorten the stall.

Admission is bounded too. A request with a large body (over :data:`LARGE_BODY_BYTES`, or of
unknown length) waits for one of ``max_large`` slots before its body is read, so a thousand
16 MiB posts wait on their connections rather than hold 16 GiB here; small requests never wait
for a slot (they may still queue briefly for a thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from aiohttp import web

T = TypeVar("T")

# A body under this is parsed without waiting for a slot: 1 MiB holds a ~250k-token prompt.
LARGE_BODY_BYTES = 1 << 20
DEFAULT_WORKERS = 2
DEFAULT_MAX_LARGE = 4


class TokenizePool:
    def __init__(self, workers: int = DEFAULT_WORKERS, max_large: int = DEFAULT_MAX_LARGE) -> None:
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="edgeinfer-tokenize")
        self._large = asyncio.Semaphore(max_large)

    @contextlib.asynccontextmanager
    async def admitted(self, content_length: int | None) -> AsyncIterator[None]:
        """Hold a slot for the block (reading and parsing the body) when the body is large."""
        if content_length is not None and content_length <= LARGE_BODY_BYTES:
            yield
            return
        async with self._large:
            yield

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a worker thread. A cancelled caller stops waiting; the call itself
        runs to its end (parsing is bounded by the model's context, see ``prompt_length``)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


POOL_KEY = web.AppKey("tokenize_pool", TokenizePool)
