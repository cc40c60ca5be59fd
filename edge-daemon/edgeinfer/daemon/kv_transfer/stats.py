"""Counters of one side of the KV transfer, read by the daemon's Prometheus module.

Deliberately dependency-free: the transfer code only increments plain attributes from a single
asyncio loop, so no locking is needed, and the metrics layer converts them on scrape (counters
map to ``*_total``, ``failures``/``dropped`` to a ``reason`` label). Latencies are not kept
here: each one goes at once to ``observe_latency`` (the daemon's Prometheus histogram), so
every transfer is counted however many happen between two scrapes. Use one instance per role
(prefill server, decode client) so the two directions stay apart.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TransferStats:
    """Monotonic counters; each transfer's latency (seconds) is handed to ``observe_latency``."""

    bytes_sent: int = 0  # every frame, headers included
    bytes_received: int = 0
    kv_bytes_sent: int = 0  # KV payload frames only: what prefix caching saves
    kv_bytes_received: int = 0
    kv_chunks_sent: int = 0
    kv_chunks_received: int = 0
    transfers_started: int = 0
    transfers_ok: int = 0
    failures: Counter[str] = field(default_factory=Counter)  # transfers that failed, by reason
    dropped: Counter[str] = field(default_factory=Counter)  # frames dropped, by reason
    latency_sum_s: float = 0.0
    latency_count: int = 0
    observe_latency: Callable[[float], None] | None = None
    # kv_pull: blocks moved against the usual direction (prefill side: received instead of
    # recomputed; decode side: served), and the prefill side's view of the link from its pulls
    # (moving averages; None until the first pull).
    pulled_blocks: int = 0
    pulls: int = 0
    pull_fallbacks: Counter[str] = field(default_factory=Counter)  # recomputed instead, by reason
    pull_rtt_s: float | None = None
    pull_link_bytes_per_s: float | None = None

    def record_sent(self, frame_bytes: int, kv_bytes: int = 0) -> None:
        self.bytes_sent += frame_bytes
        if kv_bytes:
            self.kv_bytes_sent += kv_bytes
            self.kv_chunks_sent += 1

    def record_received(self, frame_bytes: int, kv_bytes: int = 0) -> None:
        self.bytes_received += frame_bytes
        if kv_bytes:
            self.kv_bytes_received += kv_bytes
            self.kv_chunks_received += 1

    def record_ok(self, latency_s: float) -> None:
        self.transfers_ok += 1
        self.latency_sum_s += latency_s
        self.latency_count += 1
        if self.observe_latency is not None:
            self.observe_latency(latency_s)

    def record_pull(self, blocks: int, nbytes: int, first_s: float, total_s: float) -> None:
        """A completed pull: ``first_s`` until its first page (the round trip and the peer's
        export), ``total_s`` until its last; the link rate is taken over ``total_s``, so it
        errs slow."""
        self.pulled_blocks += blocks
        self.pulls += 1
        self.pull_rtt_s = _ewma(self.pull_rtt_s, first_s)
        if total_s > 0:
            self.pull_link_bytes_per_s = _ewma(self.pull_link_bytes_per_s, nbytes / total_s)

    def record_failure(self, reason: str) -> None:
        self.failures[reason] += 1

    def record_drop(self, reason: str) -> None:
        self.dropped[reason] += 1

    @property
    def total_failures(self) -> int:
        return sum(self.failures.values())

    @property
    def total_dropped(self) -> int:
        return sum(self.dropped.values())

    def snapshot(self) -> dict[str, Any]:
        """A JSON-friendly copy (for /debug endpoints, logs and benchmarks)."""
        return {
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "kv_bytes_sent": self.kv_bytes_sent,
            "kv_bytes_received": self.kv_bytes_received,
            "kv_chunks_sent": self.kv_chunks_sent,
            "kv_chunks_received": self.kv_chunks_received,
            "transfers_started": self.transfers_started,
            "transfers_ok": self.transfers_ok,
            "failures": dict(self.failures),
            "dropped": dict(self.dropped),
            "latency_sum_s": self.latency_sum_s,
            "latency_count": self.latency_count,
            "pulled_blocks": self.pulled_blocks,
            "pulls": self.pulls,
            "pull_fallbacks": dict(self.pull_fallbacks),
            "pull_rtt_s": self.pull_rtt_s,
            "pull_link_bytes_per_s": self.pull_link_bytes_per_s,
        }


_EWMA_WEIGHT = 0.25  # of the newest sample: a few pulls follow a changed link


def _ewma(average: float | None, sample: float) -> float:
    return sample if average is None else average + _EWMA_WEIGHT * (sample - average)
