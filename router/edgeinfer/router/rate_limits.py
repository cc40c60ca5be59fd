"""Per-tenant request and token windows, kept by the ``limits`` library in memory or in Redis.

Each window is a one-minute sliding window counter (``limits``' sliding-window-counter
strategy): O(1) per hit whatever the cost, in memory and in Redis alike, and without a fixed
window's double burst at the minute boundary. ``memory://`` keeps the windows in this router
process; ``redis://host:port`` (or ``valkey://``, ``rediss://``...) shares them between the
routers of a region. ``limits`` keys a window by its size too, so a tenant whose limit changes
(SIGHUP) starts a fresh window.

A Redis outage must neither take the endpoint down nor lift every limit: while Redis does not
answer, windows fall back to this process's memory (each router then enforces the limits on its
own, as without Redis), the outage is logged and counted, and Redis is tried again after
:data:`RETRY_REDIS_AFTER_S`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, TypeVar, cast

from limits import RateLimitItem, RateLimitItemPerMinute
from limits.aio.storage import MemoryStorage, SlidingWindowCounterSupport, Storage
from limits.aio.strategies import SlidingWindowCounterRateLimiter
from limits.errors import ConfigurationError, StorageError
from limits.storage import storage_from_string

from edgeinfer.shared.errors import ConfigError

log = logging.getLogger(__name__)

Kind = Literal["requests", "tokens"]
T = TypeVar("T")

WINDOW_S = 60
NAMESPACE = "edgeinfer"
# A shared store slower than this is treated as down: admission must not wait on it.
STORAGE_TIMEOUT_S = 0.5
RETRY_REDIS_AFTER_S = 5.0
# The operator writes what redis-py would take; limits wants its async flavour of each scheme.
_CREDENTIALS = re.compile(r"//[^/@\s']*@")
_SCHEMES = (
    "memory", "redis", "rediss", "redis+unix", "redis+cluster", "redis+sentinel",
    "valkey", "valkeys", "valkey+unix", "valkey+cluster", "valkey+sentinel",
)  # fmt: skip


def storage_uri(raw: str) -> str:
    """``rate_limit_storage`` as ``limits`` names it: ``redis://h:p`` -> ``async+redis://h:p``."""
    scheme, sep, rest = raw.partition("://")
    scheme = scheme.lower().removeprefix("async+")
    if not sep or scheme not in _SCHEMES:
        raise ConfigError(
            f"config key 'rate_limit_storage' must be memory:// or redis://HOST:PORT "
            f"(or {', '.join(s + '://' for s in _SCHEMES[2:])}), got {_without_password(raw)!r}"
        )
    return f"async+{scheme}://{rest}"


@dataclass(frozen=True)
class Window:
    """One tenant's window as the storage last saw it, as ``limits`` weighs it.

    The counter of the minute before (``previous``) weighs in for the part of it the sliding
    minute still covers (``previous_ttl`` seconds from now); the current minute's counter ends
    in ``current_ttl - WINDOW_S`` seconds and then decays the same way.
    """

    limit: int
    previous: int = 0
    previous_ttl: float = 0.0
    current: int = 0
    current_ttl: float = 0.0

    @property
    def used(self) -> int:
        return math.floor(self.previous * self.previous_ttl / WINDOW_S + self.current)

    @property
    def remaining(self) -> int:
        return max(0, self.limit - self.used)

    def seconds_until_room(self, cost: int) -> float:
        """When a hit of ``cost`` would pass; inf when it never can (cost > limit)."""
        room = self.limit - cost
        if room < 0:
            return math.inf
        if self.previous * self.previous_ttl / WINDOW_S + self.current <= room:
            return 0.0
        end = max(0.0, self.current_ttl - WINDOW_S)  # when the current minute ends
        if self.current <= room and self.previous:
            # The previous minute's weight alone has to fall far enough.
            return min(end, self.previous_ttl - (room - self.current) * WINDOW_S / self.previous)
        return end + WINDOW_S * (1 - room / self.current)

    def reset_s(self) -> float:
        """Until the whole limit is free again: OpenAI's ``x-ratelimit-reset-*``."""
        return self.seconds_until_room(self.limit)


class RateLimits:
    """The windows of every tenant; create with :meth:`create`, end with :meth:`close`."""

    def __init__(self, storage: Storage, description: str) -> None:
        self.description = description
        self.shared = not isinstance(storage, MemoryStorage)
        self._storage = storage
        self._local = MemoryStorage() if self.shared else storage
        self._shared = SlidingWindowCounterRateLimiter(storage)
        self._fallback = SlidingWindowCounterRateLimiter(self._local)
        self._down_until = 0.0  # monotonic time before which the shared store is not tried
        self._errors: tuple[type[BaseException], ...] = (
            StorageError, OSError, TimeoutError, *_as_tuple(storage.base_exceptions),
        )  # fmt: skip
        self.storage_errors = 0  # calls the shared store failed (then served from memory)
        self._items: dict[int, RateLimitItem] = {}

    @classmethod
    async def create(cls, raw_uri: str) -> RateLimits:
        """Connect the storage ``rate_limit_storage`` names; a shared store that does not answer
        is logged at once and tried again later (the router starts either way)."""
        uri = storage_uri(raw_uri)
        options: dict[str, float] = {}
        if not uri.startswith("async+memory"):
            options = {"connect_timeout": STORAGE_TIMEOUT_S, "stream_timeout": STORAGE_TIMEOUT_S}
        try:
            storage = storage_from_string(uri, **options)
        except (ConfigurationError, ValueError) as e:
            raise ConfigError(
                _without_password(f"config key 'rate_limit_storage' = {raw_uri!r}: {e}")
            ) from e
        if not isinstance(storage, Storage) or not isinstance(storage, SlidingWindowCounterSupport):
            raise ConfigError(f"rate_limit_storage {raw_uri!r} cannot keep sliding windows")
        limits = cls(storage, _without_password(raw_uri))
        if limits.shared:
            await limits.window("requests", "-", 1)  # a read: logs an outage now if there is one
        return limits

    @property
    def degraded(self) -> bool:
        """True while the shared store is down and windows live in this process's memory."""
        return self._down_until > 0.0

    async def hit(self, kind: Kind, tenant: str, limit: int, cost: int = 1) -> bool:
        """Take ``cost`` from the window if it has room; False (nothing taken) if it has not."""
        item = self._item(limit)
        return await self._run(lambda lim: lim.hit(item, kind, tenant, cost=cost))

    async def consume(self, kind: Kind, tenant: str, limit: int, cost: int) -> None:
        """Count ``cost`` already spent (tokens of an answer): as much as the window holds.

        ``limits`` refuses a hit past the limit and cannot overdraw; a full window refuses the
        tenant's next requests until it slides, which is what the overdraft would have done.
        """
        if cost < 1 or await self.hit(kind, tenant, limit, cost):
            return
        room = (await self.window(kind, tenant, limit)).remaining
        if room > 0:
            await self.hit(kind, tenant, limit, min(room, cost))

    async def window(self, kind: Kind, tenant: str, limit: int) -> Window:
        key = self._item(limit).key_for(kind, tenant)

        async def read(lim: SlidingWindowCounterRateLimiter) -> Window:
            storage = cast(SlidingWindowCounterSupport, lim.storage)  # checked in create()
            previous, previous_ttl, current, current_ttl = await storage.get_sliding_window(
                key, WINDOW_S
            )
            return Window(limit, previous, previous_ttl, current, current_ttl)

        return await self._run(read)

    async def close(self) -> None:
        for storage in {self._storage, self._local}:
            timer = getattr(storage, "timer", None)  # MemoryStorage's expiry task
            if isinstance(timer, asyncio.Task):
                timer.cancel()
        if self.shared:
            client = getattr(getattr(self._storage, "bridge", None), "storage", None)
            pool = getattr(client, "connection_pool", None)
            if pool is not None:
                pool.disconnect()

    def _item(self, limit: int) -> RateLimitItem:
        item = self._items.get(limit)
        if item is None:
            item = self._items[limit] = RateLimitItemPerMinute(limit, namespace=NAMESPACE)
        return item

    async def _run(self, op: Callable[[SlidingWindowCounterRateLimiter], Awaitable[T]]) -> T:
        if self.shared and time.monotonic() >= self._down_until:
            try:
                async with asyncio.timeout(STORAGE_TIMEOUT_S):
                    result = await op(self._shared)
            except self._errors as e:
                self._outage(e)
            else:
                if self._down_until:
                    log.warning(
                        "rate-limit store %s answers again: limits shared", self.description
                    )
                    self._down_until = 0.0
                return result
        return await op(self._fallback)

    def _outage(self, exc: BaseException) -> None:
        self.storage_errors += 1
        if not self._down_until:
            log.error(
                "rate-limit store %s failed (%s: %s): limits are enforced by this router alone "
                "until it answers again",
                self.description, type(exc).__name__, exc or "timed out",
            )  # fmt: skip
        self._down_until = time.monotonic() + RETRY_REDIS_AFTER_S


def _without_password(text: str) -> str:
    """``text`` with the credentials of every URI in it cut out: logs are read by many."""
    return _CREDENTIALS.sub("//", text)


def _as_tuple(
    exc: type[BaseException] | tuple[type[BaseException], ...],
) -> tuple[type[BaseException], ...]:
    return exc if isinstance(exc, tuple) else (exc,)
