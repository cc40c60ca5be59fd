"""Ending requests whose decode daemon died while they waited on it.

A daemon whose process dies closes its sockets, and the proxy sees that at once. A daemon whose
host vanishes (power, a partition) closes nothing: a request waiting for a non-streaming answer
would wait for the whole ``request_timeout_s``. Its heartbeats stop too, though, and the registry
marks it ``stale`` after a few periods; this watch checks the registry once per heartbeat period
and expires the deadline of every request still waiting on a stale daemon, which then ends with
a 502 (or an SSE error event) instead of hanging.

Only ``stale`` counts: ``down`` (a connect error seen by another request) or a drain says the
daemon takes nothing new, not that the work it holds is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

from edgeinfer.router.pop_registry import PopRegistry


class Watched:
    """One request waiting on one daemon; ``lost`` once that daemon stopped heartbeating."""

    __slots__ = ("_deadline", "lost", "url")

    def __init__(self, url: str) -> None:
        self.url = url
        self.lost = False
        self._deadline: asyncio.Timeout | None = None

    def arm(self, deadline: asyncio.Timeout) -> None:
        """Expire ``deadline`` (an entered ``asyncio.timeout``) when the daemon is lost."""
        self._deadline = deadline
        if self.lost:
            self._expire()

    def fire(self) -> None:
        self.lost = True
        self._expire()

    def _expire(self) -> None:
        deadline = self._deadline
        if deadline is not None and not deadline.expired():
            with contextlib.suppress(RuntimeError):  # already left, or already expiring
                deadline.reschedule(asyncio.get_running_loop().time())


class DaemonWatch:
    def __init__(self, registry: PopRegistry, period_s: float) -> None:
        self._registry = registry
        self._period_s = period_s
        self._watched: dict[str, set[Watched]] = {}

    @contextlib.contextmanager
    def watching(self, url: str) -> Iterator[Watched]:
        watched = Watched(url)
        self._watched.setdefault(url, set()).add(watched)
        try:
            yield watched
        finally:
            members = self._watched[url]
            members.discard(watched)
            if not members:
                del self._watched[url]

    def check(self, now: float) -> int:
        """Fire every request waiting on a stale daemon; returns how many were fired."""
        if not self._watched:
            return 0
        stale = {v.url for v in self._registry.snapshot(now) if v.state == "stale"}
        fired = 0
        for url in stale & self._watched.keys():
            for watched in self._watched[url]:
                if not watched.lost:
                    watched.fire()
                    fired += 1
        return fired

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._period_s)
            self.check(time.monotonic())
