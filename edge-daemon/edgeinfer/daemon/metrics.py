"""Prometheus metrics of one daemon, named like vLLM's with the prefix ``edgeinfer_``.

Every app owns a :class:`DaemonMetrics` with its own ``CollectorRegistry``, so two apps in one
process (tests) never share series. Three sources feed it:

* per-request latencies and outcomes, through a :class:`RequestTimer` per engine request;
* engine state (queue lengths, KV blocks, prefix cache, token counters), read from an
  :class:`EngineStats` snapshot that the ``/metrics`` handler takes just before rendering, so
  the values are exact at scrape time and nothing polls the engine in between;
* the KV-transfer code, through :meth:`DaemonMetrics.kv_bytes` and its siblings.

Prefix-cache queries and hits count KV *blocks* (vLLM counts tokens): the engine caches whole
blocks, so blocks are what it can report without guessing.
"""

from __future__ import annotations

import time
from collections import Counter as CounterDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from edgeinfer.daemon.engine.outputs import EngineStats, RequestOutput
from edgeinfer.daemon.heartbeat import RecentMedian
from edgeinfer.daemon.kv_transfer.stats import TransferStats

PREFIX = "edgeinfer_"

KVDirection = Literal["sent", "received"]
Outcome = Literal["success", "client_disconnect", "invalid", "rejected", "error"]

# Bucket edges follow vLLM's so dashboards built for it read the same.
_TTFT_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0),
    *(7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
_TOKEN_BUCKETS = (
    *(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0),
    *(7.5, 10.0, 20.0, 40.0, 80.0),
)
_E2E_BUCKETS = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0),
    *(60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)
_LENGTH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
RECENT_WINDOW = 512  # latencies kept for the heartbeat's p50s, at most...
RECENT_S = 30.0  # ...and only this recent (an idle daemon reports none: RecentMedian)
_TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _EngineCollector(Collector):
    """Turns the latest :class:`EngineStats` snapshot into gauges and counters."""

    def __init__(self) -> None:
        self.stats: EngineStats | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        if s is None:  # still loading: report nothing rather than zeros that look real
            return
        gauges = {
            "num_requests_running": ("Requests in the running batch.", s.num_running),
            "num_requests_waiting": ("Requests waiting to be scheduled.", s.num_waiting),
            "num_requests_remote_pending": (
                "Decode-side requests waiting for KV pages from a prefill peer.",
                s.num_remote_pending,
            ),
            "num_requests_prefilled_held": (
                "Prefilled requests holding KV blocks until their transfer ends.",
                s.num_prefilled_held,
            ),
            "kv_cache_usage_perc": (
                "Fraction of KV blocks in use, 0-1 (free prefix-cached blocks count as free).",
                s.kv_cache_usage,
            ),
            "kv_blocks_used": ("KV blocks held by requests.", s.kv_blocks_used),
            "kv_blocks_total": ("KV blocks in the cache.", s.kv_blocks_total),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)
        counters = {
            "prefix_cache_queries": (
                "KV blocks looked up in the prefix cache.",
                s.prefix_cache_queries,
            ),
            "prefix_cache_hits": ("KV blocks found in the prefix cache.", s.prefix_cache_hits),
            "prompt_tokens_computed": (
                "Prompt tokens computed (prefix-cache hits excluded).",
                s.prompt_tokens_computed,
            ),
            "generation_tokens": ("Tokens generated.", s.generation_tokens),
            "num_preemptions": ("Requests preempted to free KV blocks.", s.num_preemptions),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(PREFIX + name, doc, value=value)


class DaemonMetrics:
    def __init__(self) -> None:
        self._synced: dict[int, _Seen] = {}
        # Recent TTFT and inter-token latencies (seconds) for the heartbeat's p50 fields.
        self.recent_ttft = RecentMedian(RECENT_S, RECENT_WINDOW)
        self.recent_itl = RecentMedian(RECENT_S, RECENT_WINDOW)
        self.registry = CollectorRegistry()
        reg = self.registry
        self._engine = _EngineCollector()
        reg.register(self._engine)
        self.request_success = Counter(
            PREFIX + "request_success",
            "Requests that finished normally, by finish reason.",
            ["finished_reason"],
            registry=reg,
        )
        self.requests = Counter(
            PREFIX + "requests",
            "Generation requests by outcome (success, client_disconnect, invalid, rejected "
            "(draining), error) and tenant (the router's, on requests with the daemon key).",
            ["outcome", "tenant"],
            registry=reg,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", registry=reg
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            buckets=_TTFT_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between two consecutive outputs of one request.",
            buckets=_TOKEN_BUCKETS,
            registry=reg,
        )
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "Per request: decode time divided by the tokens after the first.",
            buckets=_TOKEN_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            buckets=_E2E_BUCKETS,
            registry=reg,
        )
        self.request_prompt_tokens = Histogram(
            PREFIX + "request_prompt_tokens",
            "Prompt length of finished requests.",
            buckets=_LENGTH_BUCKETS,
            registry=reg,
        )
        self.request_generation_tokens = Histogram(
            PREFIX + "request_generation_tokens",
            "Generated tokens of finished requests.",
            buckets=_LENGTH_BUCKETS,
            registry=reg,
        )
        self._kv_bytes = Counter(
            PREFIX + "kv_transfer_bytes",
            "KV-cache bytes moved between daemons.",
            ["direction"],
            registry=reg,
        )
        self._kv_seconds = Histogram(
            PREFIX + "kv_transfer_seconds",
            "Duration of one request's KV transfer.",
            buckets=_TRANSFER_BUCKETS,
            registry=reg,
        )
        self._kv_failures = Counter(
            PREFIX + "kv_transfer_failures",
            "KV transfers that failed, by reason.",
            ["reason"],
            registry=reg,
        )
        self._kv_dropped = Counter(
            PREFIX + "kv_transfer_dropped_frames",
            "Received KV-transfer messages dropped, by reason (wire error codes).",
            ["reason"],
            registry=reg,
        )
        self._kv_pulled = Counter(
            PREFIX + "kv_pulled_blocks",
            "KV blocks moved by kv_pull: received by a prefill daemon instead of recomputing "
            "them, or sent by the decode daemon that held them.",
            ["direction"],
            registry=reg,
        )

    # ---- engine snapshot ---------------------------------------------------------------
    def set_engine_stats(self, stats: EngineStats) -> None:
        self._engine.stats = stats

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- requests ------------------------------------------------------------------------
    def timer(self) -> RequestTimer:
        return RequestTimer(self)

    def outcome(self, outcome: Outcome, tenant: str | None = None) -> None:
        self.requests.labels(outcome=outcome, tenant=tenant or "").inc()

    # ---- KV transfer (called by the transfer code) ---------------------------------------
    def kv_bytes(self, direction: KVDirection, n: int) -> None:
        self._kv_bytes.labels(direction=direction).inc(n)

    def kv_transfer_time(self, seconds: float) -> None:
        self._kv_seconds.observe(seconds)

    def kv_failure(self, reason: str) -> None:
        self._kv_failures.labels(reason=reason).inc()

    def kv_dropped_frame(self, reason: str) -> None:
        self._kv_dropped.labels(reason=reason).inc()

    def sync_transfer_stats(self, stats: TransferStats, direction: KVDirection) -> None:
        """Move what the transfer code counted since the last scrape into the Prometheus
        metrics (the transfer code stays free of prometheus_client). Latencies are not here:
        the stats hand each to :meth:`kv_transfer_time` as it happens."""
        seen = self._synced.setdefault(id(stats), _Seen())
        kv = stats.kv_bytes_sent if direction == "sent" else stats.kv_bytes_received
        self.kv_bytes(direction, kv - seen.kv_bytes)
        seen.kv_bytes = kv
        # A pull moves pages against the transfer's direction: the prefill side receives them.
        pull_direction: KVDirection = "received" if direction == "sent" else "sent"
        self._kv_pulled.labels(direction=pull_direction).inc(
            stats.pulled_blocks - seen.pulled_blocks
        )
        seen.pulled_blocks = stats.pulled_blocks
        for reason, count in stats.failures.items():
            self._kv_failures.labels(reason=reason).inc(count - seen.failures[reason])
            seen.failures[reason] = count
        for reason, count in stats.dropped.items():
            self._kv_dropped.labels(reason=reason).inc(count - seen.dropped[reason])
            seen.dropped[reason] = count


@dataclass
class _Seen:
    """What :meth:`DaemonMetrics.sync_transfer_stats` already exported of one stats object."""

    kv_bytes: int = 0
    pulled_blocks: int = 0
    failures: CounterDict[str] = field(default_factory=CounterDict)
    dropped: CounterDict[str] = field(default_factory=CounterDict)


class RequestTimer:
    """Latency bookkeeping of one engine request, fed with each of its outputs."""

    def __init__(self, metrics: DaemonMetrics) -> None:
        self._m = metrics
        self._arrival = time.monotonic()
        self._first: float | None = None
        self._last = self._arrival

    def observe(self, out: RequestOutput) -> None:
        now = time.monotonic()
        if out.new_token_ids:
            if self._first is None:
                self._first = now
                self._m.ttft.observe(now - self._arrival)
                self._m.recent_ttft.add(now - self._arrival, now)
            else:
                self._m.itl.observe(now - self._last)
                self._m.recent_itl.add(now - self._last, now)
            self._last = now
        if out.finished and out.finish_reason in ("stop", "length"):
            self._finished(out, now)

    def _finished(self, out: RequestOutput, now: float) -> None:
        m = self._m
        m.request_success.labels(finished_reason=out.finish_reason).inc()
        m.e2e.observe(now - self._arrival)
        m.prompt_tokens.inc(out.num_prompt_tokens)
        m.request_prompt_tokens.observe(out.num_prompt_tokens)
        m.request_generation_tokens.observe(out.num_output_tokens)
        if self._first is not None and out.num_output_tokens > 1:
            m.tpot.observe((self._last - self._first) / (out.num_output_tokens - 1))
