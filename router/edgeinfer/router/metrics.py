"""Prometheus metrics of one router, served at ``/metrics`` (ops network; no key needed).

Every app owns a :class:`RouterMetrics` with its own ``CollectorRegistry``, so several apps in
one process (tests) never share series. Label values are bounded: ``route`` is the matched route
template (``unmatched`` for the rest, never the raw path), ``tenant`` a name from the operator's
keys file (empty without one), ``pop`` a configured PoP. Nothing here can hold a key.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from edgeinfer.router.gate import GATE_KEY
from edgeinfer.router.request_context import CONTEXT_KEY

PREFIX = "edgeinfer_router_"
CLIENT_CLOSED = 499  # nginx's status for a client that left before its answer started

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_PLACEMENT_BUCKETS = (
    *(0.00002, 0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1),
)
_DURATION_BUCKETS = (
    *(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0),
    600.0,
)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            PREFIX + "requests", "Answers by route, HTTP status, tenant and decode PoP.",
            ["route", "status", "tenant", "pop"], registry=r,
        )  # fmt: skip
        self.request_seconds = Histogram(
            PREFIX + "request_duration_seconds", "Arrival to last byte, by route.",
            ["route"], buckets=_DURATION_BUCKETS, registry=r,
        )  # fmt: skip
        self.placement_seconds = Histogram(
            PREFIX + "placement_seconds", "Time to choose the placements of one request.",
            buckets=_PLACEMENT_BUCKETS, registry=r,
        )  # fmt: skip
        self.upstream_retries = Counter(
            PREFIX + "upstream_retries", "Requests moved to another placement, by reason.",
            ["reason"], registry=r,
        )  # fmt: skip
        self.daemon_lost = Counter(
            PREFIX + "daemon_lost",
            "Requests ended because their decode daemon stopped heartbeating.", registry=r,
        )  # fmt: skip
        self.unauthorized = Counter(
            PREFIX + "unauthorized", "Requests refused for a missing or unknown API key (401).",
            registry=r,
        )  # fmt: skip
        self.rate_limited = Counter(
            PREFIX + "rate_limited", "Requests refused by a rate or concurrency limit (429).",
            registry=r,
        )  # fmt: skip
        self.streams_in_flight = Gauge(
            PREFIX + "streams_in_flight", "SSE streams being relayed to clients now.", registry=r
        )
        self.tokenize_seconds = Histogram(
            PREFIX + "tokenize_seconds",
            "Time to tokenise one request and hash its blocks (for prefix-aware placement).",
            buckets=_PLACEMENT_BUCKETS, registry=r,
        )  # fmt: skip
        self.tokenize_tokens = Counter(
            PREFIX + "tokenize_tokens", "Prompt tokens the router computed for placement.",
            registry=r,
        )  # fmt: skip
        self.tokenize_tokens_cached = Counter(
            PREFIX + "tokenize_tokens_cached",
            "Of those, tokens of prompt pieces already encoded (the router's piece cache).",
            registry=r,
        )  # fmt: skip
        self.prefix_blocks_asked = Counter(
            PREFIX + "prefix_blocks_asked",
            "Full prompt blocks looked up in the prefix index (hit rate: matched / asked).",
            registry=r,
        )  # fmt: skip
        self.prefix_blocks_matched = Counter(
            PREFIX + "prefix_blocks_matched",
            "Of the blocks asked, those cached where the request was placed (prefill side).",
            registry=r,
        )  # fmt: skip
        self.requests_in_flight = Gauge(
            PREFIX + "requests_in_flight", "Requests being answered now.", registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


METRICS_KEY = web.AppKey("metrics", RouterMetrics)


class GateCollector:
    """The shared rate-limit store's health, read from the app's Gate at each scrape (the Gate
    starts with the app's services, after the metrics exist)."""

    def __init__(self, app: web.Application) -> None:
        self._app = app

    def collect(self) -> Iterator[Metric]:
        gate = self._app.get(GATE_KEY)
        errors = CounterMetricFamily(
            PREFIX + "rate_limit_storage_errors",
            "Calls to the shared rate-limit store that failed or timed out (served from memory).",
        )
        errors.add_metric([], gate.storage_errors if gate is not None else 0)
        degraded = GaugeMetricFamily(
            PREFIX + "rate_limit_storage_degraded",
            "1 while the shared rate-limit store is down and this router enforces limits alone.",
        )
        degraded.add_metric([], 1 if gate is not None and gate.degraded else 0)
        yield errors
        yield degraded


@web.middleware
async def metrics_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    metrics = request.app[METRICS_KEY]
    started = time.monotonic()
    status = CLIENT_CLOSED
    metrics.requests_in_flight.inc()
    try:
        resp = await handler(request)
        status = resp.status
        return resp
    finally:
        metrics.requests_in_flight.dec()
        ctx = request[CONTEXT_KEY]
        if status == CLIENT_CLOSED and ctx.response is not None:
            status = ctx.response.status  # a stream cut short still answered with its status
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        metrics.requests.labels(route, str(status), ctx.tenant, ctx.pop).inc()
        metrics.request_seconds.labels(route).observe(time.monotonic() - started)
        if status == 401:
            metrics.unauthorized.inc()
        elif status == 429:
            metrics.rate_limited.inc()


async def metrics_handler(request: web.Request) -> web.StreamResponse:
    body = request.app[METRICS_KEY].render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
