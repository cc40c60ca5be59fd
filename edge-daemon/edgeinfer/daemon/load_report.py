"""What the daemon says about its load: the heartbeat it publishes and its measured rates.

Engine statistics live in the engine thread, so a background task copies a snapshot every
heartbeat period (through ``AsyncEngine.call``); the heartbeat callback, which must not wait,
reads that snapshot. Prefill and decode rates are tokens per *busy* second of engine steps,
fed from the engine thread after each step.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any

from edgeinfer.daemon.config import DaemonConfig
from edgeinfer.daemon.engine.async_engine import AsyncEngine
from edgeinfer.daemon.engine.errors import EngineError
from edgeinfer.daemon.engine.outputs import EngineStats
from edgeinfer.daemon.heartbeat import RateMeter
from edgeinfer.daemon.kv_events import kv_bytes_per_token, tokenizer_id
from edgeinfer.daemon.metrics import DaemonMetrics
from edgeinfer.shared.tasks import cancel_and_wait


class LoadTracker:
    def __init__(
        self,
        config: DaemonConfig,
        engine: AsyncEngine,
        metrics: DaemonMetrics,
        status: Callable[[], tuple[bool, bool, int]],
    ) -> None:
        """``status`` returns (draining, drained, requests in flight) of the daemon."""
        self.config = config
        self.engine = engine
        self.metrics = metrics
        self.status = status
        self.stats: EngineStats | None = None
        self._prefill = RateMeter()
        self._decode = RateMeter()
        self._lock = threading.Lock()  # the meters are fed by the engine thread
        self._task: asyncio.Task[None] | None = None
        # The served model's constants for the router (read from the engine at start).
        self.invariants: dict[str, Any] = {}
        engine.on_step = self._on_step

    def _on_step(self, seconds: float, prompt_tokens: int, decoded: int) -> None:
        # A mixed step's time counts against both stages: a conservative rate for each (the
        # running streams did wait that long). A step whose only token is a new request's first
        # is prefill alone: counted as decode it priced a daemon that had served one 1k-token
        # prompt at 3 tokens/s, an ITL of a second.
        with self._lock:
            if prompt_tokens:
                self._prefill.add(prompt_tokens, seconds)
            if decoded:
                self._decode.add(decoded, seconds)

    def rates(self) -> tuple[float, float]:
        with self._lock:
            return self._prefill.rate(), self._decode.rate()

    async def refresh(self) -> EngineStats | None:
        with contextlib.suppress(EngineError):
            self.stats = await self.engine.call(lambda e: e.stats())
        return self.stats

    async def start(self) -> None:
        cfg = self.config
        kv_bytes, tok_id = await self.engine.call(
            lambda e: (kv_bytes_per_token(e), tokenizer_id(e))
        )
        self.invariants = {
            "kv_bytes_per_token": kv_bytes,
            "local_prefill_threshold": cfg.local_prefill_threshold,
            "prefill_chunk_tokens": cfg.max_num_batched_tokens,
            "tokenizer_id": tok_id,
            "prefix_caching": cfg.enable_prefix_caching,
        }
        await self.refresh()
        self._task = asyncio.create_task(self._run(), name="edgeinfer-load-report")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)

    async def _run(self) -> None:
        # Twice per heartbeat period, so a heartbeat never carries a snapshot older than that.
        while True:
            await asyncio.sleep(self.config.heartbeat_interval_s / 2)
            await self.refresh()

    @property
    def daemon_id(self) -> str:
        return f"http://{self.config.public_host}:{self.config.port}"

    def heartbeat(self) -> dict[str, Any]:
        """The heartbeat fields this daemon owns (the publisher adds v, seq and times)."""
        cfg, s = self.config, self.stats
        draining, drained, in_flight = self.status()
        prefill_rate, decode_rate = self.rates()
        return {
            "daemon_id": self.daemon_id,
            "pop": cfg.pop,
            "role": cfg.role,
            "model": cfg.model_name,
            "kv_endpoint": cfg.kv_endpoint if cfg.role != "decode" else None,
            "running": s.num_running if s else 0,
            "waiting": s.num_waiting if s else 0,
            "kv_blocks_free": (s.kv_blocks_total - s.kv_blocks_used) if s else 0,
            "kv_blocks_total": s.kv_blocks_total if s else 0,
            "block_size": cfg.block_size,
            "prefill_tokens_per_s": prefill_rate,
            "decode_tokens_per_s": decode_rate,
            "ttft_p50_s": self.metrics.recent_ttft.median(),
            "itl_p50_s": self.metrics.recent_itl.median(),
            "queued_prefill_tokens": s.queued_prompt_tokens if s else 0,
            "draining": draining,
            "drained": drained,
            "in_flight": in_flight,
            **self.invariants,
        }
