"""Reading and decoding request bodies; large ones in another process, so that a huge post
costs the streams in flight no GIL time.

A 16 MiB JSON body takes ~10 ms to decode, all of it holding the GIL: no token is written and
the engine thread runs no Python meanwhile. Measured on 2 cores with 8 streams and 4 clients
posting 16 MiB prompts (``bench/hostile_prompts.py``), that decode alone was about a third of
the streams' longest token gap under attack. Here the body is read from the socket into a
file mapping shared with a worker process (:mod:`~edgeinfer.daemon.api.body_worker`, one per
daemon, started at the first large body, at a low priority), which decodes it and sends back
its shape (:mod:`~edgeinfer.daemon.api.body_shape`). An over-long prompt is then refused from
the shape's lengths (``refuse``); any other body is decoded in the daemon as before (in full,
or from the shape when nothing was long).

Without the worker (it cannot start, it died, it answered garbage) the daemon decodes the body
itself: slower under attack, never wrong. Only one body is in the buffer at a time: the large
body slot (:class:`~edgeinfer.daemon.api.tokenize_pool.TokenizePool`) already admits one, and
a lock here makes sure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import sys
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
from aiohttp import hdrs, web

from edgeinfer.daemon.api.body_shape import NOT_AN_OBJECT, NOT_JSON, Long, Shape, decode_shape
from edgeinfer.daemon.api.body_worker import FRAME, READY, SIZE
from edgeinfer.daemon.api.errors import APIError

log = logging.getLogger(__name__)

# A body under this is parsed without waiting for a slot (tokenize_pool) and decoded in the
# daemon: 1 MiB holds a ~250k-token prompt.
LARGE_BODY_BYTES = 1 << 20
# The daemon's body limit (its app's client_max_size; larger: 413). Prompts arrive as JSON;
# 128k token ids take about 1 MiB, aiohttp's default limit.
MAX_BODY_BYTES = 16 << 20

# Raises the refusal a shape's lengths prove (an APIError), or returns.
Refuse = Callable[[dict[str, Any], Mapping[str, Long]], None]


def load_json(raw: bytes | bytearray | memoryview) -> dict[str, Any]:
    try:
        # msgspec, not orjson: a 16 MiB body decodes in about half the time, and decoding
        # holds the GIL (the event loop and the engine thread wait) from start to end.
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise APIError(400, NOT_JSON.format(exc)) from exc
    if not isinstance(body, dict):
        raise APIError(400, NOT_AN_OBJECT)
    return body


async def decode_body(request: web.Request, decoder: BodyDecoder, refuse: Refuse) -> dict[str, Any]:
    """The request's JSON object: a large body through ``decoder``, others in the daemon."""
    size = request.content_length
    if size is None or size > MAX_BODY_BYTES or hdrs.CONTENT_ENCODING in request.headers:
        return load_json(await request.read())  # 413, or a length that is not the body's
    if size <= LARGE_BODY_BYTES:
        return load_json(await read_body(request))
    return await decoder.decode(request, size, refuse)


async def read_body(request: web.Request) -> bytes | bytearray:
    """The request's body, copied once: into a buffer of its declared length. aiohttp's
    ``read()`` grows a bytearray chunk by chunk and then copies it into bytes, all on the event
    loop with the GIL held: on a 16 MiB body, more of the loop's time than decoding the JSON
    (py-spy). A body without a length, over the limit (413) or compressed (its length is not
    the decoded one) goes through ``read()``."""
    size = request.content_length
    if size is None or size > MAX_BODY_BYTES or hdrs.CONTENT_ENCODING in request.headers:
        return await request.read()
    body = bytearray(size)
    with memoryview(body) as view:
        await _read_into(request, view)
    return body


class BodyDecoder:
    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._lock = asyncio.Lock()
        self._buffer: mmap.mmap | None = None
        self._worker: asyncio.subprocess.Process | None = None
        # An exchange whose caller went away: the next body waits for its answer.
        self._pending: asyncio.Future[Shape | None] | None = None
        self._broken = False  # no worker could start: do not try on every body

    @property
    def worker_pid(self) -> int | None:
        """The worker's process id while one runs."""
        w = self._worker
        return w.pid if w is not None and w.returncode is None else None

    async def decode(self, request: web.Request, size: int, refuse: Refuse) -> dict[str, Any]:
        """The JSON object of ``request``'s body of ``size`` bytes (at most the capacity),
        or the APIError a malformed or over-long body gets."""
        async with self._lock:
            if self._pending is not None:
                await asyncio.wait([self._pending])
                self._pending = None
            worker = await self._ready()
            if worker is None or self._buffer is None:
                return load_json(await read_body(request))
            # Both views released on the way out, whatever happens: a closed buffer must
            # have none.
            with memoryview(self._buffer) as whole, whole[:size] as body:
                await _read_into(request, body)
                shape = await self._ask(worker, size)
                if shape is None:
                    return load_json(body)
                if shape.error is not None:
                    raise APIError(400, shape.error)
                if shape.body is not None:
                    if not shape.long:
                        return shape.body
                    refuse(shape.body, shape.long)
                # Might be served (or the shape was too large to send): decoded in full here.
                return load_json(body)

    async def _ready(self) -> asyncio.subprocess.Process | None:
        """The running worker, or a new one on a new buffer (the old buffer's name is gone)."""
        if self._worker is not None and self._worker.returncode is None:
            return self._worker
        self._worker = None
        if self._broken:
            return None
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None
        try:
            buffer, path = _shared_buffer(self._capacity)
        except OSError as exc:
            log.warning("large request bodies are decoded in the daemon: no buffer (%s)", exc)
            self._broken = True
            return None
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "edgeinfer.daemon.api.body_worker", path,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            )  # fmt: skip
            if proc.stdout is None or await proc.stdout.readexactly(len(READY)) != READY:
                proc.kill()
                raise RuntimeError("the worker did not say it was ready")
        except (OSError, RuntimeError, asyncio.IncompleteReadError) as exc:
            log.warning("large request bodies are decoded in the daemon: no worker (%s)", exc)
            buffer.close()
            self._broken = True
            return None
        finally:
            # The worker has mapped it (or never will): the name is no longer needed.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self._buffer, self._worker = buffer, proc
        return proc

    async def _ask(self, worker: asyncio.subprocess.Process, size: int) -> Shape | None:
        """The worker's shape of the body in the buffer; None if the worker failed. A caller
        cancelled meanwhile (its client hung up) leaves the exchange to finish on its own:
        killing the worker instead would let a client make the daemon start one per post."""
        exchange = asyncio.ensure_future(self._exchange(worker, size))
        self._pending = exchange
        shape = await asyncio.shield(exchange)
        self._pending = None
        return shape

    async def _exchange(self, worker: asyncio.subprocess.Process, size: int) -> Shape | None:
        stdin, stdout = worker.stdin, worker.stdout
        if stdin is None or stdout is None:
            return None
        try:
            stdin.write(SIZE.pack(size))
            await stdin.drain()
            (length,) = FRAME.unpack(await stdout.readexactly(FRAME.size))
            return decode_shape(await stdout.readexactly(length))
        except (OSError, asyncio.IncompleteReadError, msgspec.DecodeError) as exc:
            log.warning("body worker failed (%s); decoding in the daemon, restarting it", exc)
            if worker.returncode is None:
                worker.kill()
            return None

    async def close(self) -> None:
        async with self._lock:
            if self._pending is not None:
                await asyncio.wait([self._pending])
            worker, self._worker = self._worker, None
            if worker is not None and worker.returncode is None and worker.stdin is not None:
                worker.stdin.close()
                try:
                    await asyncio.wait_for(worker.wait(), timeout=2.0)
                except TimeoutError:
                    worker.kill()
                    await worker.wait()
            if self._buffer is not None:
                self._buffer.close()
                self._buffer = None


def _shared_buffer(capacity: int) -> tuple[mmap.mmap, str]:
    """A file mapping of ``capacity`` bytes another process can map by the returned name."""
    # tmpfs where there is one: the body never touches a disk.
    directory = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    fd, path = tempfile.mkstemp(prefix="edgeinfer-body-", dir=directory)
    try:
        os.ftruncate(fd, capacity)
        buffer = mmap.mmap(fd, capacity)
    except OSError:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return buffer, path


async def _read_into(request: web.Request, view: memoryview) -> memoryview:
    """``view`` filled with the body: aiohttp's parser delivers exactly Content-Length bytes,
    or raises if the connection ends first."""
    filled = 0
    while chunk := await request.content.readany():
        view[filled : filled + len(chunk)] = chunk
        filled += len(chunk)
    return view
