"""Passing one daemon's answer to the client: headers filtered, bytes as they arrive.

SSE bytes are forwarded as they arrive, cut only at event boundaries: a partial event is held
until its blank line arrives, so a stream that breaks mid-event can still end cleanly with an
error event. A plain (JSON) body cannot carry an error once its headers are sent, so a failure
there cuts the connection: a short body cannot pass for a complete one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from edgeinfer.router.daemon_watch import Watched
from edgeinfer.router.gate import Admission
from edgeinfer.router.metrics import RouterMetrics
from edgeinfer.router.openai_api import sse_error_event
from edgeinfer.router.selector import Placement

log = logging.getLogger(__name__)

PREFILL_POP_HEADER = "x-edge-prefill-pop"
DECODE_POP_HEADER = "x-edge-decode-pop"
# Never forwarded to a daemon: connection-level headers, the client's credentials (a daemon
# gets the router's own key instead) and the id the router re-issues. ``x-edge-*`` go too.
_DROP_REQUEST = frozenset(
    {"connection", "keep-alive", "proxy-authorization", "proxy-connection", "te", "trailer",
     "transfer-encoding", "upgrade", "host", "content-length", "authorization", "cookie",
     "x-request-id"}
)  # fmt: skip
# Never passed back: connection-level headers, and what the router sets itself (the request id,
# CORS, which aiohttp-cors adds and insists it alone sets).
_DROP_RESPONSE = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "trailer", "transfer-encoding",
     "upgrade", "content-length", "date", "server", "x-request-id"}
)  # fmt: skip
_EVENT_ENDS = (b"\n\n", b"\r\n\r\n", b"\r\r")


class SseFramer:
    """Splits a byte stream at SSE event boundaries, holding back only an unfinished event."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._pending + chunk
        cut = max(data.rfind(end) + len(end) if end in data else 0 for end in _EVENT_ENDS)
        self._pending = data[cut:]
        return data[:cut]

    def flush(self) -> bytes:
        """What is left at the end of a stream that did not end on a blank line."""
        data, self._pending = self._pending, b""
        return data


@dataclass
class Exchange:
    """One request on one daemon, after the daemon accepted it (sent its headers)."""

    request: web.Request
    upstream: aiohttp.ClientResponse
    placement: Placement
    watched: Watched
    deadline: float  # loop time of request_timeout_s
    read_timeout_s: float  # longest silence inside an SSE stream
    admission: Admission | None
    metrics: RouterMetrics
    _silent: bool = False  # the stream was cut for a silence of read_timeout_s

    async def relay(self) -> web.StreamResponse:
        """Send the accepted answer to the client, chunk by chunk as the daemon produces it."""
        request, upstream = self.request, self.upstream
        resp = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        resp.headers.extend(kept_headers(upstream.headers, _DROP_RESPONSE))
        resp.headers.update(pop_headers(self.placement))
        framer = SseFramer() if upstream.content_type == "text/event-stream" else None
        if upstream.content_length is not None and framer is None:
            resp.content_length = upstream.content_length
        try:
            await resp.prepare(request)
            if framer is None:
                await self._copy(resp, None)
            else:
                self.metrics.streams_in_flight.inc()
                try:
                    await self._copy(resp, framer)
                finally:
                    self.metrics.streams_in_flight.dec()
        except (aiohttp.ClientError, TimeoutError) as e:
            upstream.close()
            reason = self._why(e)
            log.warning("%s via %s broke mid-body: %s", request.path, upstream.url, reason)
            if framer is None:
                if request.transport is not None:
                    request.transport.abort()
                return resp
            # The held partial event is dropped: whole events, then the error, then the end.
            await resp.write(sse_error_event(f"the daemon failed mid-stream ({reason})"))
        except asyncio.CancelledError:
            upstream.close()  # the client left, or shutdown's grace ran out: tell the daemon
            if framer is not None:
                # At shutdown the client is still there: end its stream with an error event
                # rather than a cut (when the client itself left, this write simply fails).
                with contextlib.suppress(Exception):
                    await resp.write(sse_error_event("the router is shutting down"))
            raise
        except BaseException:
            upstream.close()
            raise
        await resp.write_eof()
        return resp

    async def _copy(self, resp: web.StreamResponse, framer: SseFramer | None) -> None:
        content, admission = self.upstream.content, self.admission
        sse = framer is not None
        loop = asyncio.get_running_loop()
        async with asyncio.timeout_at(self.deadline) as limit:
            self.watched.arm(limit)
            silence = _SilenceTimer(loop, limit, self.read_timeout_s) if sse else None
            try:
                while True:
                    if silence is not None:  # only waits on the daemon count, not a slow client
                        silence.waiting_since = loop.time()
                    raw = await content.readany()
                    if silence is not None:
                        silence.waiting_since = None
                    if not raw:  # end of the daemon's body
                        out = framer.flush() if framer is not None else b""
                    else:
                        out = framer.feed(raw) if framer is not None else raw
                    if out:
                        if admission is not None:
                            admission.observe(out, sse)
                        await resp.write(out)
                    if not raw:
                        break
            finally:
                if silence is not None:
                    silence.cancel()
                    self._silent = silence.fired
        self.upstream.release()  # fully read: the pooled connection is reused

    def _why(self, e: BaseException) -> str:
        if isinstance(e, aiohttp.ClientError):  # some of aiohttp's are TimeoutErrors too
            return type(e).__name__
        if self.watched.lost:
            self.metrics.daemon_lost.inc()
            return "the daemon stopped sending heartbeats"
        if self._silent:
            return f"silent for read_timeout_s ({self.read_timeout_s:g} s)"
        return "request_timeout_s exceeded"


class _SilenceTimer:
    """Expires ``limit`` once one wait for the daemon's next bytes has lasted ``window`` s.

    One timer per stream, moved only when it fires early: a chunk costs two stores, where an
    ``asyncio.timeout`` per read would cost a timer (and its cancellation) per token.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, limit: asyncio.Timeout, window: float):
        self.loop, self.limit, self.window = loop, limit, window
        self.waiting_since: float | None = None  # None while the client is being written to
        self.fired = False
        self._handle = loop.call_at(loop.time() + window, self._check)

    def _check(self) -> None:
        now = self.loop.time()
        since = self.waiting_since
        if since is None or now < since + self.window:
            due = now + self.window if since is None else since + self.window
            self._handle = self.loop.call_at(due, self._check)
            return
        self.fired = True
        if not self.limit.expired():
            self.limit.reschedule(self.loop.time())

    def cancel(self) -> None:
        self._handle.cancel()


def pop_headers(placement: Placement) -> dict[str, str]:
    """Where a request ran; prefill is the decode PoP itself when the daemon prefills locally."""
    prefill = placement.prefill if placement.prefill is not None else placement.decode
    return {PREFILL_POP_HEADER: prefill.pop, DECODE_POP_HEADER: placement.decode.pop}


def client_request_headers(request: web.Request) -> CIMultiDict[str]:
    """The client's end-to-end headers a daemon may see, plus ``X-Forwarded-For``."""
    headers = kept_headers(request.headers, _DROP_REQUEST)
    if request.remote:
        prior = request.headers.get("X-Forwarded-For")
        headers["X-Forwarded-For"] = f"{prior}, {request.remote}" if prior else request.remote
    return headers


def daemon_response_headers(headers: Mapping[str, str]) -> CIMultiDict[str]:
    return kept_headers(headers, _DROP_RESPONSE)


def kept_headers(headers: Mapping[str, str], drop: frozenset[str]) -> CIMultiDict[str]:
    """End-to-end headers only; ``x-edge-*`` are the router's to set, in either direction, and
    ``access-control-*`` are the router's CORS policy, not a daemon's."""
    return CIMultiDict(
        (k, v)
        for k, v in headers.items()
        if (low := k.lower()) not in drop and not low.startswith(("x-edge-", "access-control-"))
    )
