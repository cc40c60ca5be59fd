"""Keeping the prefix index equal to the daemons' caches: event batches, gaps and snapshots.

Each daemon numbers its cache-event batches (``seq`` from 1 per process). Per daemon the router
is *synced* (every batch up to ``seq`` applied on top of a snapshot or of an empty start) or
*resyncing* (a snapshot wanted; batches arriving meanwhile are buffered). It resyncs when:

- it first hears a daemon whose ``kv_event_seq`` is past 0 (the router started late);
- a batch skips a number, or a heartbeat counts a batch never received (the PUB socket drops
  messages for a slow subscriber, and the last batch before a quiet spell has no successor to
  reveal its loss);
- a daemon restarts (a changed ``started_at``): its entries are cleared first; a new process
  whose first batch is 1 needs no snapshot (it started empty).

Snapshots come over HTTP (``GET /v1/kv_snapshot``) from :class:`SnapshotFetcher`; one names the
batch it includes, so buffered batches after it are applied and earlier ones dropped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import Counter
from collections.abc import Iterator

import aiohttp
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from edgeinfer.router.daemon_key import DaemonKey
from edgeinfer.router.prefix_index import PrefixIndex, U64Array, key_array, sorted_keys
from edgeinfer.shared.heartbeat import (
    KEY_BYTES,
    Heartbeat,
    HeartbeatError,
    KvEvents,
    KvSnapshot,
)
from edgeinfer.shared.tasks import cancel_and_wait

log = logging.getLogger(__name__)

# Batches kept per daemon while its snapshot is fetched; past that the snapshot will be stale
# anyway, so the buffer is dropped and another snapshot asked for once this one lands.
MAX_BUFFERED = 4096
_MAX_RETRY_S = 30.0  # a failing snapshot fetch is retried with back-off up to this


@dataclasses.dataclass
class _Sync:
    started_at: float
    seq: int = 0  # last batch applied
    synced: bool = False
    buffered: list[KvEvents] = dataclasses.field(default_factory=list)
    overflow: bool = False  # buffer dropped: the snapshot in flight is not enough
    requested: bool = False  # a snapshot is queued or being fetched


class KvSync:
    """Per-daemon sequencing of cache events into a :class:`PrefixIndex` (no I/O: it asks
    :class:`SnapshotFetcher` through :attr:`wanted`)."""

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self.counts: Counter[str] = Counter()  # events, keys, gaps, resyncs, restarts, ...
        self.wanted: set[str] = set()  # daemons whose snapshot should be fetched
        self.wake = asyncio.Event()
        self._daemons: dict[str, _Sync] = {}

    def synced(self, url: str) -> bool:
        st = self._daemons.get(url)
        return st is not None and st.synced

    def forget(self, url: str) -> None:
        self._daemons.pop(url, None)
        self.wanted.discard(url)
        self.index.forget(url)

    def on_heartbeat(self, url: str, hb: Heartbeat) -> None:
        """A heartbeat the registry accepted: restarts, lost trailing batches, first contact."""
        if not hb.prefix_caching:
            self.forget(url)
            return
        # The registry judged this heartbeat current (even one with an older started_at, after
        # a silence: a restart with the clock stepped back), so it sets the incarnation.
        st = self._current(url, hb.started_at, authoritative=True)
        if st is None:
            return
        if st.synced and hb.kv_event_seq > st.seq:
            self.counts["gaps"] += 1
            self._resync(url, st, f"heartbeat counts batch {hb.kv_event_seq}, have {st.seq}")
        elif not st.synced and not st.requested:
            if hb.kv_event_seq == 0 and not st.buffered:
                st.synced = True  # nothing cached yet, nothing missed
            else:
                self._resync(url, st, "first contact")

    def on_events(self, url: str, ev: KvEvents) -> str:
        """Apply or buffer one batch; returns the verdict the listener counts."""
        st = self._current(url, ev.started_at)
        if st is None:
            return "kv_stale"
        self.counts["events"] += 1
        if not st.synced:
            if ev.first_seq == 1 and not st.buffered and not st.requested:
                st.synced = True  # the process's first batch: everything from an empty cache
            else:
                self._buffer(url, st, ev)
                return "kv_buffered"
        if ev.seq <= st.seq:
            return "kv_duplicate"
        if ev.first_seq > st.seq + 1:
            self.counts["gaps"] += 1
            self._resync(url, st, f"batches {st.seq + 1}..{ev.first_seq - 1} lost")
            self._buffer(url, st, ev)
            return "kv_gap"
        self._apply(url, st, ev)
        return "kv_applied"

    def on_snapshot(self, url: str, snap: KvSnapshot, keys: U64Array | None = None) -> bool:
        """Install a fetched snapshot (``keys``: :func:`sorted_keys` of it, if computed off the
        loop); False when it no longer fits (the daemon restarted meanwhile: fetch again)."""
        st = self._daemons.get(url)
        if st is None or snap.started_at != st.started_at:
            return False
        self.index.replace(url, keys if keys is not None else sorted_keys(snap.keys))
        st.seq, st.synced, st.requested = snap.seq, True, False
        buffered, st.buffered = st.buffered, []
        if st.overflow:
            st.overflow = False
            self._resync(url, st, "events overflowed while the snapshot was fetched")
            return True
        self.counts["snapshots"] += 1
        for ev in buffered:
            if ev.seq <= st.seq:
                continue
            if ev.first_seq > st.seq + 1:
                self._resync(url, st, "a gap among the batches buffered during a snapshot")
                return True
            self._apply(url, st, ev)
        return True

    def retry(self, url: str) -> None:
        """A fetch failed or came too late: ask again if the daemon still needs one."""
        st = self._daemons.get(url)
        if st is not None and not st.synced:
            st.requested = True
            self.wanted.add(url)
            self.wake.set()

    def _current(self, url: str, started_at: float, authoritative: bool = False) -> _Sync | None:
        st = self._daemons.get(url)
        if st is not None and started_at == st.started_at:
            return st
        if st is not None:
            if started_at < st.started_at and not authoritative:
                return None  # a late message of an older incarnation
            self.counts["restarts"] += 1
            log.info("daemon %s restarted: its prefix-cache entries are cleared", url)
        self.index.forget(url)
        self.wanted.discard(url)
        st = self._daemons[url] = _Sync(started_at)
        return st

    def _apply(self, url: str, st: _Sync, ev: KvEvents) -> None:
        self.index.apply(url, key_array(ev.stored), key_array(ev.removed))
        self.counts["keys"] += (len(ev.stored) + len(ev.removed)) // KEY_BYTES
        st.seq = ev.seq

    def _buffer(self, url: str, st: _Sync, ev: KvEvents) -> None:
        if len(st.buffered) >= MAX_BUFFERED:
            st.buffered.clear()
            st.overflow = True
        st.buffered.append(ev)

    def _resync(self, url: str, st: _Sync, why: str) -> None:
        self.counts["resyncs"] += 1
        log.info("prefix index of %s: resync (%s)", url, why)
        st.synced, st.requested = False, True
        self.wanted.add(url)
        self.wake.set()


class SnapshotFetcher:
    """Fetches the snapshots :class:`KvSync` wants, a few at a time (a router starting beside
    700 daemons would otherwise pull 2 GB at once)."""

    def __init__(
        self,
        sync: KvSync,
        session: aiohttp.ClientSession,
        daemon_key: DaemonKey | None = None,
        *,
        concurrency: int = 4,
        retry_s: float = 1.0,
        timeout_s: float = 30.0,
    ) -> None:
        self.sync = sync
        self._session = session
        self._daemon_key = daemon_key
        self._concurrency = concurrency
        self._retry_s = retry_s
        self._failures: Counter[str] = Counter()  # consecutive failures per daemon: back-off
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kv-snapshots")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    async def _run(self) -> None:
        sem = asyncio.Semaphore(self._concurrency)
        active: set[str] = set()
        tasks: set[asyncio.Task[None]] = set()

        async def one(url: str) -> None:
            try:
                async with sem:
                    ok = await self._fetch(url)
                if not ok:  # wait outside the semaphore: a dead daemon holds no fetch slot
                    n = self._failures[url] = self._failures[url] + 1
                    await asyncio.sleep(min(self._retry_s * 2 ** (n - 1), _MAX_RETRY_S))
                    self.sync.retry(url)
                else:
                    self._failures.pop(url, None)
            finally:
                active.discard(url)
                self.sync.wake.set()

        try:
            while True:
                self.sync.wake.clear()
                for url in list(self.sync.wanted - active):
                    active.add(url)
                    self.sync.wanted.discard(url)
                    task = asyncio.create_task(one(url), name=f"kv-snapshot {url}")
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                await self.sync.wake.wait()
        finally:
            for task in list(tasks):
                await cancel_and_wait(task)

    async def _fetch(self, url: str) -> bool:
        """Fetch and install one snapshot; False when it failed (to be retried)."""
        headers = self._daemon_key.headers() if self._daemon_key is not None else None
        try:
            async with self._session.get(
                url + "/v1/kv_snapshot", headers=headers, timeout=self._timeout
            ) as resp:
                if resp.status != 200:
                    raise HeartbeatError(f"/v1/kv_snapshot answered {resp.status}")
                body = await resp.read()
            snap = KvSnapshot.decode(body)
            if snap.daemon_id.rstrip("/") != url:
                raise HeartbeatError(f"snapshot names daemon {snap.daemon_id!r}")
            keys = await asyncio.to_thread(sorted_keys, snap.keys)
        except (aiohttp.ClientError, TimeoutError, HeartbeatError) as e:
            self.sync.counts["snapshot_errors"] += 1
            level = logging.DEBUG if self._failures[url] else logging.INFO
            log.log(level, "prefix index of %s: snapshot failed (%s); will retry", url, e)
            return False
        if not self.sync.on_snapshot(url, snap, keys):
            self.sync.retry(url)  # the daemon restarted meanwhile: its new snapshot, at once
        return True


class KvSyncCollector(Collector):
    """Prometheus view of the prefix index and its feed, read at scrape time."""

    def __init__(self, sync: KvSync) -> None:
        self.sync = sync

    def collect(self) -> Iterator[Metric]:
        sync, index, p = self.sync, self.sync.index, "edgeinfer_router_prefix_index_"
        yield GaugeMetricFamily(p + "blocks", "(block, daemon) pairs held.", value=len(index))
        yield GaugeMetricFamily(p + "bytes", "Approximate memory of the index.", index.nbytes())
        synced = sum(1 for url in index.daemons() if sync.synced(url))
        yield GaugeMetricFamily(p + "daemons_synced", "Daemons whose events are applied.", synced)
        for name, key, doc in (
            ("events", "events", "Cache-event batches received from daemons."),
            ("event_keys", "keys", "Block keys stored or evicted, as applied."),
            ("gaps", "gaps", "Lost event batches noticed (a seq skipped)."),
            ("resyncs", "resyncs", "Snapshots asked for (first contact, gap, overflow)."),
            ("snapshots", "snapshots", "Snapshots installed."),
            ("snapshot_errors", "snapshot_errors", "Snapshot fetches that failed."),
            ("restarts", "restarts", "Daemon restarts that cleared their entries."),
        ):
            yield CounterMetricFamily(p + name, doc, value=sync.counts[key])
