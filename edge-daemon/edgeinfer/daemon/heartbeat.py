"""The daemon's side of heartbeats: a ZeroMQ PUB socket and the meters that feed it.

The daemon binds; every router connects a SUB socket to it (the routers know the daemons from
their PoP table, a daemon does not know the routers). PUB never blocks: a router that is slow or
gone only loses heartbeats, which is the right failure for data that is stale after one period.

The schema lives in :mod:`edgeinfer.shared.heartbeat`. The publisher owns the fields that
describe the *stream* (``v``, ``seq``, ``started_at``, ``sent_at``, ``kv_event_seq``); the
``state`` callback supplies the rest, as a mapping or as a whole :class:`Heartbeat` whose stream
fields are replaced. With a :class:`~edgeinfer.daemon.kv_events.KvEventLog` it also sends the
prefix cache's change batches, on the same socket so that a router receives every batch before
the heartbeat that counts it.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from edgeinfer.daemon.kv_events import KvEventLog
from edgeinfer.shared.heartbeat import HEARTBEAT_VERSION, Heartbeat
from edgeinfer.shared.tasks import cancel_and_wait

log = logging.getLogger(__name__)

StateFn = Callable[[], Heartbeat | Mapping[str, Any]]

# Heartbeats are worthless once the next one exists, but cache events are not: a router that
# falls this many messages behind loses some, sees the gap in their seq and fetches a snapshot.
_SEND_HWM = 1000


class RateMeter:
    """Tokens per *busy* second over a sliding window.

    Feed it once per engine step with the tokens the step produced and how long the step ran.
    Dividing by busy time, not wall time, measures speed rather than demand: an idle daemon is
    not a slow one. When the window holds no work the last measured rate is kept, because
    hardware does not get slower by idling; it reads 0.0 only until the first sample.
    """

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._clock = clock
        # Samples are merged into buckets of window/20 so memory stays bounded at any step rate.
        self._bucket_s = window_s / 20
        self._samples: deque[list[float]] = deque()  # [bucket start, tokens, busy seconds]
        self._tokens = 0.0
        self._busy = 0.0
        self._last_rate = 0.0

    def add(self, tokens: int, busy_s: float, now: float | None = None) -> None:
        if tokens < 0 or busy_s < 0:
            raise ValueError(f"tokens and busy_s must be >= 0, got {tokens}, {busy_s}")
        now = self._clock() if now is None else now
        if self._samples and now - self._samples[-1][0] < self._bucket_s:
            self._samples[-1][1] += tokens
            self._samples[-1][2] += busy_s
        else:
            self._samples.append([now, float(tokens), busy_s])
        self._tokens += tokens
        self._busy += busy_s
        self._expire(now)

    def rate(self, now: float | None = None) -> float:
        self._expire(self._clock() if now is None else now)
        if self._busy > 0:
            self._last_rate = self._tokens / self._busy
        return self._last_rate

    def _expire(self, now: float) -> None:
        while self._samples and self._samples[0][0] <= now - self.window_s:
            _, tokens, busy = self._samples.popleft()
            self._tokens -= tokens
            self._busy -= busy
        if not self._samples:  # reset exactly so float drift cannot accumulate
            self._tokens = self._busy = 0.0


class RecentMedian:
    """The median of the values seen in the last ``window_s`` seconds (the latest ``maxlen`` of
    them): a heartbeat's TTFT or ITL p50, None when none is that recent.

    Latency, unlike speed, depends on load, so an idle daemon must not keep reporting its last
    busy spell's: a daemon whose ITL went over the SLO under a burst was priced over it from
    then on, got no new request while any daemon was within it, and so never measured again.
    Reporting nothing once the samples age out makes the router price it as a daemon that has
    not measured itself (its model's median, ``placement.Assumed``).
    """

    def __init__(
        self, window_s: float = 30.0, maxlen: int = 512, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if window_s <= 0 or maxlen < 1:
            raise ValueError(f"window_s must be > 0 and maxlen >= 1, got {window_s}, {maxlen}")
        self.window_s = window_s
        self._clock = clock
        self._samples: deque[tuple[float, float]] = deque(maxlen=maxlen)  # (time, value)

    def add(self, value: float, now: float | None = None) -> None:
        self._samples.append((self._clock() if now is None else now, value))

    def median(self, now: float | None = None) -> float | None:
        since = (self._clock() if now is None else now) - self.window_s
        samples = self._samples
        while samples and samples[0][0] <= since:
            samples.popleft()
        return statistics.median(v for _, v in samples) if samples else None


class HeartbeatPublisher:
    """Publishes ``state()`` as a :class:`Heartbeat` every ``interval_s`` on a PUB socket."""

    def __init__(
        self,
        bind: str,
        interval_s: float,
        state: StateFn,
        *,
        context: zmq.asyncio.Context | None = None,
        started_at: float | None = None,
        listen_fd: int | None = None,
        events: KvEventLog | None = None,
    ) -> None:
        """``listen_fd``: a TCP socket already bound and listening (the daemon binds its ports
        at start-up) that the PUB socket adopts instead of binding ``bind`` itself."""
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.bind = bind
        self.interval_s = interval_s
        self._state = state
        self._context = context or zmq.asyncio.Context.instance()
        self.started_at = time.time() if started_at is None else started_at
        self._listen_fd = listen_fd
        self.events = events
        self._events_ready = asyncio.Event()
        self._events_task: asyncio.Task[None] | None = None
        self.endpoint: str | None = None  # the resolved address once bound (port 0 / "*")
        self._seq = 0
        self._socket: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def seq(self) -> int:
        """The seq the next heartbeat will carry."""
        return self._seq

    async def start(self) -> None:
        if self._socket is not None:
            raise RuntimeError("heartbeat publisher already started")
        sock = self._context.socket(zmq.PUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, _SEND_HWM)
        if self._listen_fd is not None:
            sock.setsockopt(zmq.USE_FD, self._listen_fd)
        sock.bind(self.bind)
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._socket = sock
        self._task = asyncio.create_task(self._run(), name="heartbeat-publisher")
        if self.events is not None:
            loop, ready = asyncio.get_running_loop(), self._events_ready

            def wake() -> None:
                loop.call_soon_threadsafe(ready.set)

            self.events.on_push = wake
            self._events_task = asyncio.create_task(self._run_events(), name="kv-events")

    async def stop(self) -> None:
        if self.events is not None:
            self.events.on_push = lambda: None
        if self._events_task is not None:
            await cancel_and_wait(self._events_task)
            self._events_task = None
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    async def publish_now(self) -> Heartbeat:
        """Send one heartbeat at once (e.g. when draining starts, so routers stop sooner)."""
        if self._socket is None:
            raise RuntimeError("heartbeat publisher not started")
        state = self._state()
        if isinstance(state, Heartbeat):
            state = msgspec.structs.asdict(state)
        hb = Heartbeat(
            **{
                **state,
                "v": HEARTBEAT_VERSION,
                "kv_event_seq": self.events.published_seq if self.events is not None else 0,
                "seq": self._seq,
                "started_at": self.started_at,
                "sent_at": time.time(),
            }
        )
        await self._socket.send(hb.encode())
        self._seq += 1
        return hb

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            try:
                await self.publish_now()
            # A failing state callback must cost one heartbeat, not every future one: the
            # router reads silence as "down", so the loop keeps trying. (Cancellation is a
            # BaseException and still ends the loop.)
            except Exception:
                log.exception("heartbeat not sent")
            # Fixed-rate schedule; after a stall skip the missed beats instead of bursting them.
            next_at = max(next_at + self.interval_s, loop.time())
            await asyncio.sleep(next_at - loop.time())

    async def _run_events(self) -> None:
        events, sock = self.events, self._socket
        if events is None or sock is None:
            return
        while True:
            await self._events_ready.wait()
            self._events_ready.clear()
            msg = events.take()
            if msg is None:
                continue
            # A full queue drops for the slow router only (PUB never blocks); its gap check
            # recovers. published_seq moves on either way: the batch exists, it was offered.
            # A batch that could not be sent at all shows as a gap too (the next one's first_seq).
            try:
                await sock.send(msg.encode())
            except zmq.ZMQError:
                log.exception("prefix-cache events %d..%d not sent", msg.first_seq, msg.seq)
                continue
            events.published_seq = msg.seq
