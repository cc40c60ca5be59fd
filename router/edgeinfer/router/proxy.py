"""Forwarding one OpenAI request to the best decode daemon, naming its prefill daemon.

A request is committed to a daemon once that daemon accepts it, i.e. answers with response
headers of any status but 503 or 401. Before that, a connect failure (the request never reached
the daemon), a 503 (the daemon refused it: draining, loading, full) or a 401 (the daemon refused
the router's own key: a misconfiguration, logged, never shown to the client as its key's fault)
moves it to the next-best placement (``max_retries`` more at most). After it, the request is never sent elsewhere: the
daemon may be generating, and a second daemon would run the generation twice. A failure then
reaches the client: a 502/504 error object before any byte of the answer, an SSE error event
inside a stream, or a cut connection inside a plain body (:mod:`edgeinfer.router.relay`).

Time: one limit, ``request_timeout_s``, runs from arrival to the last byte; nothing else times
the wait for a daemon's headers, which for a non-streaming request arrive only with the whole
answer. A daemon that dies is noticed through its connection (its process closes it) or its
heartbeats (:mod:`edgeinfer.router.daemon_watch`), and inside an SSE stream a silence of
``read_timeout_s`` ends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import time
from collections import Counter
from collections.abc import Iterator

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from edgeinfer.router.config import RouterConfig
from edgeinfer.router.daemon_key import DaemonKey
from edgeinfer.router.daemon_watch import DaemonWatch
from edgeinfer.router.gate import CACHE_SALT_HEADER
from edgeinfer.router.geo import ClientLocator, GeoPoint
from edgeinfer.router.metrics import RouterMetrics
from edgeinfer.router.network import NetworkModel
from edgeinfer.router.openai_api import error_response, no_placement
from edgeinfer.router.pop_registry import DaemonView, PopRegistry
from edgeinfer.router.prefix_lookup import PrefixLookup
from edgeinfer.router.relay import (
    Exchange,
    client_request_headers,
    daemon_response_headers,
    pop_headers,
)
from edgeinfer.router.request_context import RequestContext
from edgeinfer.router.selector import (
    Placement,
    PlacementConfig,
    RequestFeatures,
    record_placement,
    select,
)
from edgeinfer.router.session_affinity import AFFINITY_HEADER, affinity_key
from edgeinfer.shared.request_ids import REQUEST_ID_HEADER

log = logging.getLogger(__name__)

PREFILL_HEADER = "x-edge-prefill"


class _Refused(Exception):
    """A placement that did not take the request; the next one may (a daemon 503 is kept to
    pass through if every placement refuses)."""

    def __init__(
        self,
        placement: Placement,
        kind: str,  # connect | unavailable | unauthorized: the retries metric's reason
        reason: str,
        upstream: tuple[bytes, CIMultiDict[str]] | None = None,
    ) -> None:
        super().__init__(reason)
        self.placement = placement
        self.kind = kind
        self.reason = reason
        self.upstream = upstream


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
        *,
        daemon_key: DaemonKey,
        watch: DaemonWatch,
        metrics: RouterMetrics,
        prefix: PrefixLookup | None = None,
    ) -> None:
        self.config = config
        self.registry = registry
        self.locator = locator
        self.net = net
        self.session = session
        self.rng = rng
        self.daemon_key = daemon_key
        self.watch = watch
        self.metrics = metrics
        self.prefix = prefix
        # The daemons advertise the rest (KV bytes per token, local prefill threshold).
        self.placement = PlacementConfig(itl_slo_s=config.itl_slo_s)
        # Requests this router has sent to each PoP and not finished: what a drain waits for.
        self.in_flight: Counter[str] = Counter()
        # Per daemon URL, prompt blocks placements found in its prefix cache (edgectl status).
        self.prefix_hit_blocks: Counter[str] = Counter()

    async def forward(
        self, request: web.Request, ctx: RequestContext, body: bytes, features: RequestFeatures,
        data: object = None,
    ) -> web.StreamResponse:  # fmt: skip
        """Place ``request`` and proxy it; the answer is the daemon's or an OpenAI error.
        ``data``: the body parsed, for the prompt's prefix hits."""
        deadline = asyncio.get_running_loop().time() + self.config.request_timeout_s
        ip = self.locator.client_ip(request.remote, request.headers)
        client = self.locator.locate(ip)
        views = self.registry.snapshot(time.monotonic())
        features = await self._prefix_features(request, ctx, data, features, views)
        now = time.monotonic()
        views = self.registry.snapshot(now)
        here = self.registry.pop(self.config.here)
        placements = select(
            views,
            client,
            features,
            self.net,
            self.placement,
            self.rng,
            self.config.here,
            1 + self.config.max_retries,
            here_point=GeoPoint(here.lat, here.lon),
            pending=self.registry.pending,
            now=now,
        )
        self.metrics.placement_seconds.observe(time.monotonic() - now)
        if not placements:
            return no_placement(views, features)
        if features.prefix is not None and features.prefix.blocks:
            best = placements[0]
            hit = best.prefill_cached // features.prefix.block_size
            self.metrics.prefix_blocks_matched.inc(hit)
            self.prefix_hit_blocks[(best.prefill or best.decode).url] += hit
        if log.isEnabledFor(logging.DEBUG):  # describe() is not free; skip it when unseen
            scores = " | ".join(p.describe() for p in placements)
            log.debug("%s from %s %s: %s", request.path, ip, features, scores)
        refusals: list[_Refused] = []
        for placement in placements:
            if not self._still_placeable(placement):
                continue  # drained since select() ran: a drain is acknowledged at once
            # Counted on the daemons until their heartbeats show it, so the next decisions
            # do not price the same stale load; a placement that never got there is not.
            ticket = record_placement(self.registry.pending, placement, features, time.monotonic())
            ctx.pop = placement.decode.pop
            try:
                return await self._attempt(request, ctx, body, placement, deadline)
            except _Refused as refusal:
                self.registry.pending.cancel(ticket)
                refusals.append(refusal)
                self.metrics.upstream_retries.labels(refusal.kind).inc()
                level = logging.ERROR if refusal.kind == "unauthorized" else logging.WARNING
                log.log(
                    level, "%s not taken by %s (%s)", request.path, placement.decode.url,
                    refusal.reason,
                )  # fmt: skip
        ctx.pop = ""
        return _give_up(refusals)

    async def _prefix_features(
        self, request: web.Request, ctx: RequestContext, data: object,
        features: RequestFeatures, views: list[DaemonView],
    ) -> RequestFeatures:  # fmt: skip
        """``features`` with the prompt's exact length and prefix hits (when the router can
        tokenise it) and the client's session-affinity hint."""
        affinity = affinity_key(ctx.tenant, request.headers.get(AFFINITY_HEADER))
        prefix = None
        if self.prefix is not None and data is not None:
            salt = ctx.admission.upstream_headers() if ctx.admission is not None else {}
            prefix = await self.prefix.lookup(
                request.path, data, salt.get(CACHE_SALT_HEADER), views, features.model
            )
        if prefix is None:
            return dataclasses.replace(features, affinity=affinity) if affinity else features
        return dataclasses.replace(
            features, prompt_tokens=prefix.prompt_tokens, prefix=prefix, affinity=affinity
        )

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

    def _headers(
        self, request: web.Request, ctx: RequestContext, placement: Placement
    ) -> CIMultiDict[str]:
        """What the daemon gets: the client's end-to-end headers, then the router's own."""
        headers = client_request_headers(request)
        headers.update(self.daemon_key.headers())
        if ctx.admission is not None:
            headers.update(ctx.admission.upstream_headers())
        if placement.prefill is not None and placement.prefill.kv_endpoint:
            headers[PREFILL_HEADER] = placement.prefill.kv_endpoint
        headers[REQUEST_ID_HEADER] = ctx.request_id
        return headers

    async def _attempt(
        self,
        request: web.Request,
        ctx: RequestContext,
        body: bytes,
        placement: Placement,
        deadline: float,
    ) -> web.StreamResponse:
        decode = placement.decode
        headers = self._headers(request, ctx, placement)
        url = decode.url + request.rel_url.path_qs
        with self._track(placement), self.watch.watching(decode.url) as watched:
            upstream: aiohttp.ClientResponse | None = None
            try:
                async with asyncio.timeout_at(deadline) as limit:
                    watched.arm(limit)
                    upstream = await self.session.request(
                        request.method, url, data=body, headers=headers
                    )
                    if upstream.status == 503:  # refused, not started: another daemon may
                        kept = (await upstream.read(), CIMultiDict(upstream.headers))
                        upstream.release()
                        raise _Refused(placement, "unavailable", "HTTP 503", kept)
                    if upstream.status == 401:  # the daemon refused the router, not the client
                        await upstream.read()
                        upstream.release()
                        reason = "HTTP 401: the daemon refused the router's daemon_api_key_file"
                        raise _Refused(placement, "unauthorized", reason)
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
                # Never reached the daemon: nothing runs there, so the next placement may.
                self.registry.mark_down(decode.url, time.monotonic())
                raise _Refused(placement, "connect", f"connect failed: {e}") from e
            except _Refused:
                raise
            except (aiohttp.ClientError, TimeoutError) as e:
                # The daemon had the request: it may be generating, so no other daemon gets it.
                if upstream is not None:
                    upstream.close()
                return self._failed(request, placement, watched.lost, e)
            except BaseException:
                # Cancelled (the client went away) or a bug: drop the daemon connection so the
                # daemon sees the close and aborts the request instead of generating for nobody.
                if upstream is not None:
                    upstream.close()
                raise
            exchange = Exchange(
                request, upstream, placement, watched, deadline, self.config.read_timeout_s,
                ctx.admission, self.metrics,
            )  # fmt: skip
            return await exchange.relay()

    def _failed(
        self, request: web.Request, placement: Placement, lost: bool, e: BaseException
    ) -> web.Response:
        if isinstance(e, aiohttp.ClientError):
            status, code, reason = 502, "upstream_failed", f"{type(e).__name__}: {e}"
        elif lost:
            self.metrics.daemon_lost.inc()
            status, code, reason = 502, "upstream_failed", "the daemon stopped sending heartbeats"
        else:
            status, code, reason = 504, "timeout", "request_timeout_s exceeded"
        log.warning("%s via %s failed: %s", request.path, placement.decode.url, reason)
        resp = error_response(
            status, f"the daemon did not complete the request ({reason})",
            type="server_error", code=code,
        )  # fmt: skip
        resp.headers.update(pop_headers(placement))
        return resp


PROXY_KEY = web.AppKey("proxy", Proxy)


def _give_up(refusals: list[_Refused]) -> web.StreamResponse:
    """No placement took the request: the last daemon 503 passes through, else our own."""
    for refusal in reversed(refusals):
        if refusal.upstream is not None:
            raw, headers = refusal.upstream
            resp = web.Response(body=raw, status=503)
            resp.headers.extend(daemon_response_headers(headers))
            resp.headers.update(pop_headers(refusal.placement))
            return resp
    if not refusals:  # every placement was drained between select() and sending
        return error_response(503, "no PoP can take this request now; retry shortly",
                              type="service_unavailable_error", code="no_placement")  # fmt: skip
    detail = "; ".join(f"{r.placement.decode.url}: {r.reason}" for r in refusals)
    return error_response(502, f"no daemon could be reached ({detail})",
                          type="server_error", code="upstream_failed")  # fmt: skip
