"""The router's side of heartbeats: one ZeroMQ SUB socket connected to every daemon.

A single SUB socket fans in all publishers (ZeroMQ keeps one TCP connection per endpoint and
reconnects on its own), so 600 daemons cost one socket and one receive loop, not 600 tasks.
Two kinds of message arrive (schema v2, :mod:`edgeinfer.shared.heartbeat`): heartbeats and
prefix-cache event batches. Each is validated by :func:`decode_message`; a malformed one is
counted and dropped, never fatal (a version-1 heartbeat is logged once: the fleet upgrades
together). Ordering, restarts and unknown senders are judged by :meth:`PopRegistry.update` and
:meth:`PopRegistry.kv_events`, whose verdicts are counted here for the admin API.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable

import zmq
import zmq.asyncio

from edgeinfer.router.pop_registry import PopRegistry
from edgeinfer.shared.heartbeat import (
    Heartbeat,
    HeartbeatError,
    HeartbeatVersionError,
    decode_message,
)
from edgeinfer.shared.tasks import cancel_and_wait

log = logging.getLogger(__name__)

# Enough queued heartbeats for a burst from every daemon at once; beyond that they are stale.
_RECV_HWM = 10_000
_RECONNECT_IVL_MS = 100
# Daemon ids already warned about (unknown or wrong PoP); bounded so garbage cannot grow it.
_MAX_WARNED = 1024


class HeartbeatListener:
    def __init__(
        self,
        registry: PopRegistry,
        interval_s: float,
        *,
        context: zmq.asyncio.Context | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``interval_s`` is the daemons' heartbeat period: it caps the reconnect back-off so a
        restarted daemon is heard again within about one period, and sets the ZMTP keepalive
        that notices a peer whose host vanished without closing TCP."""
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.registry = registry
        self.interval_s = interval_s
        self.counts: Counter[str] = Counter()  # "received", "malformed", and update() verdicts
        self._context = context or zmq.asyncio.Context.instance()
        self._clock = clock
        self._endpoints: set[str] = set()
        self._warned: set[tuple[str, str]] = set()
        self._socket: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def endpoints(self) -> frozenset[str]:
        return frozenset(self._endpoints)

    async def start(self) -> None:
        if self._socket is not None:
            raise RuntimeError("heartbeat listener already started")
        sock = self._context.socket(zmq.SUB)
        ivl_ms = max(_RECONNECT_IVL_MS, int(self.interval_s * 1000))
        for option, value in (
            (zmq.LINGER, 0),
            (zmq.RCVHWM, _RECV_HWM),
            (zmq.RECONNECT_IVL, _RECONNECT_IVL_MS),
            (zmq.RECONNECT_IVL_MAX, ivl_ms),
            (zmq.HEARTBEAT_IVL, ivl_ms),
            (zmq.HEARTBEAT_TIMEOUT, 3 * ivl_ms),
        ):
            sock.setsockopt(option, value)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        for endpoint in self._endpoints:
            sock.connect(endpoint)
        self._socket = sock
        self._task = asyncio.create_task(self._run(), name="heartbeat-listener")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    def subscribe(self, endpoint: str) -> None:
        """Listen to one more daemon (idempotent; may be called before :meth:`start`)."""
        if endpoint in self._endpoints:
            return
        if self._socket is not None:
            self._socket.connect(endpoint)  # a bad endpoint raises ZMQError before we record it
        self._endpoints.add(endpoint)

    def unsubscribe(self, endpoint: str) -> None:
        if endpoint not in self._endpoints:
            return
        self._endpoints.discard(endpoint)
        if self._socket is not None:
            # libzmq reports ENOENT when the connection was never made (unresolvable host);
            # either way nothing of it remains.
            with contextlib.suppress(zmq.ZMQError):
                self._socket.disconnect(endpoint)

    def handle(self, frames: list[bytes]) -> None:
        """Judge one received message (public so tests can feed it without sockets)."""
        self.counts["received"] += 1
        try:
            if len(frames) != 1:
                raise HeartbeatError(f"message has {len(frames)} frames, expected 1")
            msg = decode_message(frames[0])
        except HeartbeatError as e:
            self.counts["malformed"] += 1
            if isinstance(e, HeartbeatVersionError):
                if not self.counts["old_version"]:
                    log.warning("ignoring daemon heartbeats: %s (upgrade the daemons)", e)
                self.counts["old_version"] += 1
            log.debug("dropped malformed daemon message: %s", e)
            return
        if not isinstance(msg, Heartbeat):
            self.counts[self.registry.kv_events(msg)] += 1
            return
        hb = msg
        verdict = self.registry.update(hb, self._clock())
        self.counts[verdict] += 1
        if verdict == "restart":
            log.info("daemon %s restarted (started_at %.3f)", hb.daemon_id, hb.started_at)
        elif verdict in ("unknown_daemon", "pop_mismatch"):
            key = (hb.daemon_id, verdict)
            if key not in self._warned and len(self._warned) < _MAX_WARNED:
                self._warned.add(key)
                log.warning("ignoring heartbeats of %s (PoP %r): %s", hb.daemon_id, hb.pop, verdict)

    async def _run(self) -> None:
        sock = self._socket
        if sock is None:
            return
        while True:
            self.handle(await sock.recv_multipart())
