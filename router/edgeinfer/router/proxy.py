"""Forwarding one OpenAI request to the best decode daemon, naming its prefill daemon.

A request is committed to a placement at its first body byte, not at the daemon's response
headers: a daemon sends SSE headers before it has prefilled anything, and a failure during
that prefill can still move the request to the next-best placement without the client noticing.
Until then a connect error, a timeout or a 5xx tries the next placement (``max_retries`` more at
most). After it the client has bytes, so a failure ends an SSE stream with an error event and
anything else by closing the connection (the short body then cannot pass for a complete one).

SSE bytes are forwarded as they arrive, cut only at event boundaries: a partial event is held
until its blank line arrives, so a stream that breaks mid-event can still end cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import Counter
from collections.abc import Iterator, Mapping

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from edgeinfer.router.config import RouterConfig
from edgeinfer.router.geo import ClientLocator, GeoPoint
from edgeinfer.router.network import NetworkModel
from edgeinfer.router.openai_api import (
    error_response,
    no_placement,
    request_features,
    sse_error_event,
)
from edgeinfer.router.pop_registry import PopRegistry
from edgeinfer.router.selector import Placement, PlacementConfig, record_placement, select

log = logging.getLogger(__name__)

PREFILL_HEADER = "x-edge-prefill"
PREFILL_POP_HEADER = "x-edge-prefill-pop"
DECODE_POP_HEADER = "x-edge-decode-pop"
# Never forwarded: connection-level headers, and anything a client could use to steer a
# daemon (x-edge-prefill names where KV is fetched from; only the router may choose that).
_DROP_REQUEST = frozenset(
    {"connection", "keep-alive", "proxy-authorization", "proxy-connection", "te", "trailer",
     "transfer-encoding", "upgrade", "host", "content-length"}
)  # fmt: skip
_DROP_RESPONSE = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "trailer", "transfer-encoding",
     "upgrade", "content-length", "date", "server"}
)  # fmt: skip
_EVENT_ENDS = (b"\n\n", b"\r\n\r\n", b"\r\r")


class _Failure(Exception):
    """Why one placement did not answer; a daemon's own 5xx is kept to pass through last."""

    def __init__(
        self,
        placement: Placement,
        reason: str,
        status: int = 502,
        upstream: tuple[bytes, CIMultiDict[str]] | None = None,
    ) -> None:
        super().__init__(reason)
        self.placement = placement
        self.reason = reason
        self.status = status
        self.upstream = upstream


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


class Proxy:
    """Everything a forwarded request needs; one per router process, kept in an AppKey."""

    def __init__(
        self,
        config: RouterConfig,
        registry: PopRegistry,
        locator: ClientLocator,
        net: NetworkModel,
        session: aiohttp.ClientSession,
        rng: random.Random,
    ) -> None:
        self.config = config
        self.registry = registry
        self.locator = locator
        self.net = net
        self.session = session
        self.rng = rng
        self.placement = PlacementConfig(
            itl_slo_s=config.itl_slo_s,
            kv_bytes_per_token=config.kv_bytes_per_token,
            local_prefill_max_tokens=config.local_prefill_max_tokens,
        )
        # Requests this router has sent to each PoP and not finished: what a drain waits for.
        self.in_flight: Counter[str] = Counter()

    async def forward(self, request: web.Request) -> web.StreamResponse:
        """Place ``request`` and proxy it; the answer is the daemon's or an OpenAI error."""
        body = await request.read()
        features = request_features(body)
        ip = self.locator.client_ip(request.remote, request.headers)
        client = self.locator.locate(ip)
        now = time.monotonic()
        views = self.registry.snapshot(now)
        limit = 1 + self.config.max_retries
        here = self.registry.pop(self.config.here)
        placements = select(
            views,
            client,
            features,
            self.net,
            self.placement,
            self.rng,
            self.config.here,
            limit,
            here_point=GeoPoint(here.lat, here.lon),
            pending=self.registry.pending,
            now=now,
        )
        if not placements:
            return no_placement(views, features)
        if log.isEnabledFor(logging.DEBUG):  # describe() is not free; skip it when unseen
            scores = " | ".join(p.describe() for p in placements)
            log.debug("%s from %s %s: %s", request.path, ip, features, scores)
        failures: list[_Failure] = []
        for placement in placements:
            if not self._still_placeable(placement):
                continue  # drained since select() ran: a drain is acknowledged at once
            # Counted on the daemons until their heartbeats show it, so the next decisions
            # do not price the same stale load; a placement that never got there is not.
            ticket = record_placement(self.registry.pending, placement, features, time.monotonic())
            try:
                return await self._attempt(request, body, placement)
            except _Failure as failure:
                self.registry.pending.cancel(ticket)
                failures.append(failure)
                where = f"{request.path} via {placement.decode.url}"
                log.warning("%s failed before its first byte (%s)", where, failure.reason)
        return _give_up(failures)

    def _still_placeable(self, placement: Placement) -> bool:
        chosen = [placement.decode.url] + ([placement.prefill.url] if placement.prefill else [])
        return self.registry.placeable(chosen, time.monotonic())

    @contextlib.contextmanager
    def _track(self, placement: Placement) -> Iterator[None]:
        pops = {placement.decode.pop} | ({placement.prefill.pop} if placement.prefill else set())
        self.in_flight.update(pops)
        try:
            yield
        finally:
            self.in_flight.subtract(pops)

    async def _attempt(
        self, request: web.Request, body: bytes, placement: Placement
    ) -> web.StreamResponse:
        decode = placement.decode
        headers = _request_headers(request)
        if placement.prefill is not None and placement.prefill.kv_endpoint:
            headers[PREFILL_HEADER] = placement.prefill.kv_endpoint
        with self._track(placement):
            upstream: aiohttp.ClientResponse | None = None
            framer: SseFramer | None = None
            first = b""
            try:
                async with asyncio.timeout(self.config.first_byte_timeout_s):
                    upstream = await self.session.request(
                        request.method, decode.url + request.rel_url.path_qs, data=body,
                        headers=headers,
                    )  # fmt: skip
                    if upstream.status >= 500:
                        raw = await upstream.read()
                        reason = f"HTTP {upstream.status}"
                        kept = (raw, CIMultiDict(upstream.headers))
                        raise _Failure(placement, reason, upstream.status, kept)
                    if upstream.content_type == "text/event-stream":
                        framer = SseFramer()
                    # Wait for the first whole event (or the whole body): the commit point.
                    while not first:
                        chunk = await upstream.content.readany()
                        if not chunk:
                            first = framer.flush() if framer else b""
                            break
                        first = framer.feed(chunk) if framer else chunk
            except aiohttp.ClientConnectorError as e:
                self.registry.mark_down(decode.url, time.monotonic())
                raise _Failure(placement, f"connect failed: {e.os_error}") from e
            except (aiohttp.ClientError, TimeoutError) as e:
                if upstream is not None:
                    upstream.close()
                timeout = isinstance(e, TimeoutError)
                reason = "timed out" if timeout else f"{type(e).__name__}: {e}"
                raise _Failure(placement, reason, 504 if timeout else 502) from e
            except _Failure:
                if upstream is not None:
                    upstream.release()
                raise
            except BaseException:
                # Cancelled (the client went away) or a bug: drop the daemon connection so the
                # daemon sees the close and aborts the request instead of generating for nobody.
                if upstream is not None:
                    upstream.close()
                raise
            return await _relay(request, upstream, placement, first, framer)


PROXY_KEY = web.AppKey("proxy", Proxy)


async def _relay(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    placement: Placement,
    first: bytes,
    framer: SseFramer | None,
) -> web.StreamResponse:
    """Send the committed response to the client, chunk by chunk as the daemon produces it."""
    resp = web.StreamResponse(status=upstream.status, reason=upstream.reason)
    resp.headers.extend(_kept(upstream.headers, _DROP_RESPONSE))
    resp.headers.update(pop_headers(placement))
    if upstream.content_length is not None and framer is None:
        resp.content_length = upstream.content_length
    try:
        await resp.prepare(request)
        out = first
        while True:
            if out:
                await resp.write(out)
            try:
                raw = await upstream.content.readany()
            except (aiohttp.ClientError, TimeoutError) as e:
                upstream.close()
                reason = "timed out" if isinstance(e, TimeoutError) else f"{type(e).__name__}"
                log.warning("%s via %s broke mid-body: %s", request.path, upstream.url, reason)
                if framer is not None:
                    # The held partial event is dropped: whole events, then the error, then end.
                    await resp.write(sse_error_event(f"the daemon failed mid-stream ({reason})"))
                elif request.transport is not None:
                    # A plain body cannot carry an error: cut the connection so the client sees
                    # a short body instead of a chunked one that would look complete.
                    request.transport.abort()
                    return resp
                break
            if not raw:  # end of the daemon's body
                if framer is not None:
                    await resp.write(framer.flush())
                upstream.release()  # fully read: the pooled connection is reused
                break
            out = framer.feed(raw) if framer else raw
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


def pop_headers(placement: Placement) -> dict[str, str]:
    """Where a request ran; prefill is the decode PoP itself when the daemon prefills locally."""
    prefill = placement.prefill if placement.prefill is not None else placement.decode
    return {PREFILL_POP_HEADER: prefill.pop, DECODE_POP_HEADER: placement.decode.pop}


def _request_headers(request: web.Request) -> CIMultiDict[str]:
    headers = _kept(request.headers, _DROP_REQUEST)
    if request.remote:
        prior = request.headers.get("X-Forwarded-For")
        headers["X-Forwarded-For"] = f"{prior}, {request.remote}" if prior else request.remote
    return headers


def _kept(headers: Mapping[str, str], drop: frozenset[str]) -> CIMultiDict[str]:
    """End-to-end headers only; ``x-edge-*`` are the router's to set, in either direction."""
    kept = [(k, v) for k, v in headers.items() if k.lower() not in drop]
    return CIMultiDict((k, v) for k, v in kept if not k.lower().startswith("x-edge-"))


def _give_up(failures: list[_Failure]) -> web.StreamResponse:
    """Every placement failed: the last daemon 5xx passes through, else our own 502/504."""
    for failure in reversed(failures):
        if failure.upstream is not None:
            raw, headers = failure.upstream
            resp = web.Response(body=raw, status=failure.status)
            resp.headers.extend(_kept(headers, _DROP_RESPONSE))
            resp.headers.update(pop_headers(failure.placement))
            return resp
    detail = "; ".join(f"{f.placement.decode.url}: {f.reason}" for f in failures)
    if not failures:  # every placement was drained between select() and sending
        return error_response(503, "no PoP can take this request now; retry shortly",
                              type="service_unavailable_error", code="no_placement")  # fmt: skip
    status = 504 if all(f.status == 504 for f in failures) else 502
    return error_response(status, f"no daemon could take the request ({detail})",
                          type="server_error", code="upstream_failed")  # fmt: skip
