"""Counters of one side of the KV transfer, read by the daemon's Prometheus module.

Deliberately dependency-free: the transfer code only increments plain attributes from a single
asyncio loop, so no locking is needed, and the metrics layer converts them on scrape (counters
map to ``*_total``, ``failures``/``dropped`` to a ``reason`` label, latency to a summary). Use
one instance per role (prefill server, decode client) so the two directions stay apart.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

# Enough samples for stable p50/p99 on a scrape interval without unbounded memory.
LATENCY_WINDOW = 1024


@dataclass
class TransferStats:
    """Monotonic counters plus a sliding window of transfer latencies (seconds)."""

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
    latency_samples: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))

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
        self.latency_samples.append(latency_s)

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

    def latency_quantile(self, q: float) -> float | None:
        """Nearest-rank quantile of the recent window; None before the first transfer."""
        if not self.latency_samples:
            return None
        ordered = sorted(self.latency_samples)
        q = min(max(q, 0.0), 1.0)
        return ordered[min(int(q * len(ordered)), len(ordered) - 1)]

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
            "latency_p50_s": self.latency_quantile(0.5),
            "latency_p99_s": self.latency_quantile(0.99),
        }
