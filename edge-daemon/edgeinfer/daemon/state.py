"""The daemon's lifecycle (loading, serving, draining, failed) and the app keys that hold it.

The engine loads in the background after the port is bound, so ``/health`` can answer 503
while a large model loads instead of the load balancer seeing connection refusals. Draining
stops admitting generation requests but lets in-flight ones finish; the state reads ``drained``
once none is left, which is the operator's (or SIGTERM handler's) cue to stop the process.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Iterator
from contextlib import contextmanager

from aiohttp import web

from edgeinfer.daemon.api.protocol import ModelInfo
from edgeinfer.daemon.config import DaemonConfig
from edgeinfer.daemon.engine.async_engine import AsyncEngine
from edgeinfer.daemon.metrics import DaemonMetrics
from edgeinfer.daemon.serving import RequestRunner
from edgeinfer.daemon.transfer_plane import TransferPlane


class Phase(enum.StrEnum):
    LOADING = "loading"
    SERVING = "serving"
    DRAINING = "draining"
    FAILED = "failed"


class ServingState:
    def __init__(self) -> None:
        self._phase = Phase.LOADING
        self._draining = False
        self.engine: AsyncEngine | None = None
        self.runner: RequestRunner | None = None
        self.model: ModelInfo | None = None
        self.load_error: BaseException | None = None
        self.in_flight = 0
        self.plane: TransferPlane | None = None
        self.settled = asyncio.Event()  # set once loading succeeded or failed
        self._idle = asyncio.Event()
        self._idle.set()

    # ---- lifecycle -----------------------------------------------------------------------
    def loaded(self, engine: AsyncEngine, runner: RequestRunner, model: ModelInfo) -> None:
        self.engine, self.runner, self.model = engine, runner, model
        self._phase = Phase.SERVING
        self.settled.set()

    def failed(self, exc: BaseException) -> None:
        self.load_error = exc
        self._phase = Phase.FAILED
        self.settled.set()

    @property
    def phase(self) -> Phase:
        if self._phase is Phase.SERVING and self.engine is not None and not self.engine.is_alive:
            return Phase.FAILED  # the engine thread died: nothing can be served any more
        if self._phase is Phase.SERVING and self._draining:
            return Phase.DRAINING
        return self._phase

    @property
    def transfers_in_flight(self) -> int:
        return self.plane.in_flight if self.plane is not None else 0

    @property
    def status(self) -> str:
        """``phase``, except that a drain with nothing left in flight (requests and KV
        transfers served to peers) reads ``drained``."""
        phase = self.phase
        if phase is Phase.DRAINING and self.in_flight == 0 and self.transfers_in_flight == 0:
            return "drained"
        return phase.value

    def load_status(self) -> tuple[bool, bool, int]:
        """(draining, drained, in flight) for the heartbeat."""
        return self.draining, self.status == "drained", self.in_flight + self.transfers_in_flight

    # ---- draining ------------------------------------------------------------------------
    @property
    def draining(self) -> bool:
        return self._draining

    def drain(self) -> None:
        self._draining = True

    def undrain(self) -> None:
        self._draining = False

    @contextmanager
    def track(self) -> Iterator[None]:
        """Count one generation request as in flight for the duration of the block."""
        self.in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing is in flight; False if ``timeout`` seconds passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True


CONFIG_KEY = web.AppKey("config", DaemonConfig)
STATE_KEY = web.AppKey("state", ServingState)
METRICS_KEY = web.AppKey("metrics", DaemonMetrics)
