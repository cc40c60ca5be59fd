"""What the router knows about every PoP and daemon: configuration, heartbeats, admin state.

Every writer (heartbeat listener, proxy, admin API, RTT prober) goes through the registry;
:meth:`PopRegistry.snapshot` returns immutable :class:`DaemonView` s in a list that stays the same
object until something changes (do not mutate it), so the selector caches arrays on identity.
Only changed daemons get a new view. Time (``now``, monotonic s) is passed in for tests.

The registry also holds :attr:`PopRegistry.pending`, the placements this router made that the
heartbeats do not show yet (:mod:`edgeinfer.router.inflight`): an accepted heartbeat absorbs
what it probably includes once it is in a snapshot (so that load counted in neither the pending
placements nor the snapshot never exists), a restart or a removal forgets the daemon's.

It owns the prefix index too (:attr:`PopRegistry.prefix_index`, kept current by
:attr:`PopRegistry.kv`): which daemons hold which prefix-cache blocks, from the daemons' cache
events, applied only for configured daemons in their configured PoP.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from edgeinfer.router.errors import RouterError
from edgeinfer.router.inflight import PlacementLedger
from edgeinfer.router.kv_sync import KvSync
from edgeinfer.router.prefix_index import PrefixIndex
from edgeinfer.shared.heartbeat import Heartbeat, KvEvents, Role

# A daemon silent for this many heartbeat periods is out until it speaks again: one lost
# heartbeat is noise, three in a row is a dead process or a partition.
STALE_PERIODS = 3

RTT_ALPHA = 0.3  # EWMA weight: a few probes follow a real shift, one outlier moves it < 1/3
# Load-only changes (heartbeats that change no daemon's availability, RTT probes) are folded
# into the next snapshot at most this often: 600 daemons heartbeat ~120 times a second, and each
# new snapshot makes the selector rebuild its arrays (~1 ms). 50 ms on top of a heartbeat period
# of seconds changes no decision; availability changes (drains, a daemon down or back, a first
# heartbeat) are never held back.
SNAPSHOT_COALESCE_S = 0.05

UpdateResult = Literal["accepted", "restart", "unknown_daemon", "pop_mismatch", "out_of_order"]
# DaemonView.state: "up", or why the daemon gets nothing new (stable codes for tools).
DaemonStateCode = Literal[
    "up", "no_heartbeat", "stale", "down", "admin_drained", "pop_drained", "draining", "kv_full",
    "no_kv_endpoint",
]  # fmt: skip


def normalize_url(url: str) -> str:
    """Daemon identity: the base URL without trailing slashes, so config and heartbeat agree."""
    return url.rstrip("/")


@dataclasses.dataclass(frozen=True)
class PopConfig:
    name: str
    lat: float
    lon: float
    daemons: tuple[str, ...] = ()  # HTTP base URLs of the daemons in this PoP

    def __post_init__(self) -> None:
        if not self.name:
            raise RouterError("PoP name must not be empty")
        for axis, value, limit in (("lat", self.lat, 90), ("lon", self.lon, 180)):
            if not (math.isfinite(value) and -limit <= value <= limit):
                raise RouterError(f"PoP {self.name!r}: {axis} {value} not in [-{limit}, {limit}]")
        urls = tuple(normalize_url(u) for u in self.daemons)
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise RouterError(f"PoP {self.name!r}: daemon {url!r} is not an http(s) URL")
        if len(set(urls)) != len(urls):
            raise RouterError(f"PoP {self.name!r} lists a daemon twice")
        object.__setattr__(self, "daemons", urls)


@dataclasses.dataclass(frozen=True, slots=True)
class DaemonView:
    """What the selector and the status API see of one daemon at one instant (never mutated)."""

    url: str
    pop: str
    lat: float
    lon: float
    role: Role | None  # None until the first heartbeat
    model: str | None
    kv_endpoint: str | None
    running: int
    waiting: int
    kv_blocks_free: int
    kv_blocks_total: int
    block_size: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    ttft_p50_s: float | None
    itl_p50_s: float | None
    queued_prefill_tokens: int
    in_flight: int
    # The daemon's invariants (heartbeat v2): how to price placing a request there.
    kv_bytes_per_token: int
    local_prefill_threshold: int
    prefill_chunk_tokens: int
    tokenizer_id: str | None
    draining: bool
    admin_drained: bool
    last_seen: float | None  # monotonic time of the last accepted heartbeat
    rtt_s: float | None  # this router's measured RTT EWMA to the daemon's PoP
    available: bool  # may receive new requests
    state: DaemonStateCode  # "up" when available, else the first reason code
    reason: str | None  # why not, in words, when not available


class Snapshot(list[DaemonView]):
    """Every daemon's view at one instant, and what placement derived from it (``derived``:
    its load arrays, :func:`edgeinfer.router.prepared.prepared`), which lives and dies
    with the snapshot instead of in a module global.

    ``base`` is the snapshot this one differs from only in the load of the daemons ``changed``
    (URLs): no daemon joined, left, changed availability, role or model, so what was derived
    from ``base`` may be carried over and updated. None: anything may have changed. The
    first reader drops ``base`` (a chain of snapshots would never be freed)."""

    __slots__ = ("base", "changed", "derived")

    def __init__(
        self, views: Iterable[DaemonView] = (), base: Snapshot | None = None,
        changed: frozenset[str] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(views)
        self.derived: dict[str, object] = {}
        self.base, self.changed = base, changed


@dataclasses.dataclass
class DaemonState:
    url: str
    pop: str
    heartbeat: Heartbeat | None = None
    last_seen: float | None = None
    admin_drained: bool = False
    down_since: float | None = None  # set by mark_down, cleared by the next heartbeat

    def fresh(self, now: float, period_s: float) -> bool:
        return self.last_seen is not None and now - self.last_seen <= STALE_PERIODS * period_s


class PopRegistry:
    def __init__(
        self,
        pops: Sequence[PopConfig],
        here: str,
        heartbeat_interval_s: float,
        coalesce_s: float = SNAPSHOT_COALESCE_S,
    ) -> None:
        if heartbeat_interval_s <= 0:
            raise RouterError(f"heartbeat_interval_s must be > 0, got {heartbeat_interval_s}")
        if coalesce_s < 0:
            raise RouterError(f"coalesce_s must be >= 0, got {coalesce_s}")
        self.here = here
        self.heartbeat_interval_s = heartbeat_interval_s
        self.coalesce_s = coalesce_s
        self._pops: dict[str, PopConfig] = {}
        self._daemons: dict[str, DaemonState] = {}
        self._drained_pops: set[str] = set()
        self._rtt: dict[str, float] = {}
        self._views: dict[str, DaemonView] = {}
        self._dirty: set[str] = set()
        self._urgent = False  # a dirty daemon's availability may have changed: no coalescing
        # Heartbeats not yet in a snapshot: url -> (arrival, restart). The ledger forgets what
        # they include only when they become visible, so load is never counted in neither.
        self._arrived: dict[str, tuple[float, bool]] = {}
        self._snapshot: Snapshot | None = None
        self._valid: tuple[float, float] = (0.0, 0.0)  # [built at, first freshness expiry)
        # Daemons refresh the load they report twice per period (daemon.load_report).
        self.pending = PlacementLedger(report_lag_s=heartbeat_interval_s / 2)
        self.prefix_index = PrefixIndex()
        self.kv = KvSync(self.prefix_index)
        self.replace_pops(pops)

    def replace_pops(self, pops: Sequence[PopConfig]) -> None:
        """Install a new PoP table (SIGHUP reload); daemons that remain keep their state."""
        table = {p.name: p for p in pops}
        if len(table) != len(pops):
            raise RouterError("PoP table lists a PoP name twice")
        if self.here not in table:
            raise RouterError(f"this router's PoP {self.here!r} is not in the PoP table")
        owner: dict[str, str] = {}
        for pop in pops:
            for url in pop.daemons:
                if url in owner:
                    raise RouterError(f"daemon {url!r} is in PoPs {owner[url]!r} and {pop.name!r}")
                owner[url] = pop.name
        old = self._daemons
        for url in old.keys() - owner.keys():
            self.pending.forget(url)
            self.kv.forget(url)
        self._daemons = {
            url: dataclasses.replace(old[url], pop=pop) if url in old else DaemonState(url, pop)
            for url, pop in owner.items()
        }
        self._pops = table
        self._drained_pops &= table.keys()
        self._rtt = {name: rtt for name, rtt in self._rtt.items() if name in table}
        self._views.clear()
        self._dirty = set(self._daemons)
        self._arrived = {url: a for url, a in self._arrived.items() if url in self._daemons}
        self._snapshot = None

    def pops(self) -> list[PopConfig]:
        return list(self._pops.values())

    def pop(self, name: str) -> PopConfig:
        return self._pops[self._known_pop(name)]

    def daemons(self) -> list[DaemonState]:
        """Copies of every daemon's state (callers cannot mutate the registry through them)."""
        return [dataclasses.replace(d) for d in self._daemons.values()]

    def pop_drained(self, name: str) -> bool:
        return self._known_pop(name) in self._drained_pops

    def update(self, hb: Heartbeat, now: float) -> UpdateResult:
        """Record a heartbeat; returns what happened to it (the listener counts outcomes)."""
        state = self._daemons.get(normalize_url(hb.daemon_id))
        if state is None:
            return "unknown_daemon"
        if hb.pop != state.pop:
            # The PoP table decides where a daemon is (its coordinates come from there); a daemon
            # claiming another PoP is misconfigured and stays out until one of the two is fixed.
            return "pop_mismatch"
        prev = state.heartbeat
        # Older incarnations or seqs are late or duplicated messages - unless the daemon has been
        # silent long enough to be stale, which covers a restart with a clock stepped back.
        if (
            prev is not None
            and state.fresh(now, self.heartbeat_interval_s)
            and (hb.started_at, hb.seq) <= (prev.started_at, prev.seq)
        ):
            return "out_of_order"
        restart = prev is not None and hb.started_at != prev.started_at
        if (
            prev is None
            or restart
            or state.down_since is not None
            or not state.fresh(now, self.heartbeat_interval_s)
            or _identity(hb) != _identity(prev)
        ):
            self._urgent = True
        earlier = self._arrived.get(state.url)
        self._arrived[state.url] = (now, restart or (earlier is not None and earlier[1]))
        state.heartbeat, state.last_seen, state.down_since = hb, now, None
        self._dirty.add(state.url)
        self.kv.on_heartbeat(state.url, hb)
        return "restart" if restart else "accepted"

    def kv_events(self, ev: KvEvents) -> str:
        """Feed one cache-event batch to the prefix index; returns what happened to it."""
        state = self._daemons.get(normalize_url(ev.daemon_id))
        if state is None:
            return "unknown_daemon"
        if state.heartbeat is None or state.heartbeat.pop != state.pop:
            return "kv_unplaced"  # no heartbeat yet, or one that claims another PoP
        return self.kv.on_events(state.url, ev)

    def mark_down(self, url: str, now: float) -> None:
        """Take a daemon out after a connect error, until its next heartbeat."""
        state = self._daemons.get(normalize_url(url))
        # The proxy may report a daemon that a reload has just removed; nothing to do then.
        if state is not None:
            state.down_since = now
            self._dirty.add(state.url)
            self._urgent = True

    def drain_pop(self, name: str, drained: bool = True) -> None:
        if drained:
            self._drained_pops.add(self._known_pop(name))
        else:
            self._drained_pops.discard(self._known_pop(name))
        self._dirty.update(self._pops[name].daemons)
        self._urgent = True

    def undrain_pop(self, name: str) -> None:
        self.drain_pop(name, drained=False)

    def drain_daemon(self, url: str, drained: bool = True) -> None:
        state = self._known_daemon(url)
        state.admin_drained = drained
        self._dirty.add(state.url)
        self._urgent = True

    def undrain_daemon(self, url: str) -> None:
        self.drain_daemon(url, drained=False)

    def record_rtt(self, pop: str, seconds: float) -> None:
        # A probe can finish after a reload removed its PoP; its result is then moot.
        if pop not in self._pops or not math.isfinite(seconds) or seconds < 0:
            return
        prev = self._rtt.get(pop)
        self._rtt[pop] = seconds if prev is None else prev + RTT_ALPHA * (seconds - prev)
        self._dirty.update(self._pops[pop].daemons)

    def rtt(self, pop: str) -> float | None:
        return self._rtt.get(self._known_pop(pop))

    def in_flight(self, pop: str, now: float | None = None) -> int:
        """Requests in flight in a PoP, per its daemons' fresh heartbeats (a dead daemon's last
        count would otherwise linger)."""
        now = time.monotonic() if now is None else now
        states = [self._daemons[url] for url in self._pops[self._known_pop(pop)].daemons]
        fresh = [d.heartbeat for d in states if d.fresh(now, self.heartbeat_interval_s)]
        return sum(hb.in_flight for hb in fresh if hb is not None)

    def snapshot(self, now: float) -> list[DaemonView]:
        """Every daemon's view; the same list object until something changes (see
        ``SNAPSHOT_COALESCE_S`` for how long load-only changes may wait)."""
        built_at, expires_at = self._valid
        if (
            self._snapshot is not None
            and built_at <= now < expires_at
            and (not self._dirty or (not self._urgent and now - built_at < self.coalesce_s))
        ):
            return self._snapshot
        # A freshness deadline passed (or time ran backwards): every view may have changed.
        prev = self._snapshot
        stale = prev is None or not built_at <= now < expires_at
        changed = None if stale or self._urgent else frozenset(self._dirty)
        for url, (arrived, restart) in self._arrived.items():
            if restart:
                self.pending.forget(url)  # the new process has none of the old one's work
            else:
                self.pending.absorb(url, arrived)
        self._arrived.clear()
        for url in self._daemons if stale else self._dirty:
            self._views[url] = self._build_view(self._daemons[url], now)
        self._dirty.clear()
        self._urgent = False
        # The cached list stays valid until the first fresh daemon could go stale.
        period = STALE_PERIODS * self.heartbeat_interval_s
        seen = [d.last_seen for d in self._daemons.values() if d.last_seen is not None]
        self._valid = (now, min((t + period for t in seen if t + period >= now), default=math.inf))
        base = None
        if prev is not None and changed is not None:
            # Load only: derive from prev, or, when nothing was derived from prev, from what
            # prev would have been derived from.
            if prev.derived:
                base = prev
            elif prev.base is not None and prev.changed is not None:
                base, changed = prev.base, prev.changed | changed
        if prev is not None:
            prev.base = None
        self._snapshot = Snapshot(
            (self._views[url] for url in self._daemons), base, changed if base else None
        )
        return self._snapshot

    def placeable(self, urls: Iterable[str], now: float) -> bool:
        """Whether every daemon of ``urls`` may still receive new requests (as of a snapshot
        at ``now``): a drain between a decision and its sending is honoured at once."""
        self.snapshot(now)
        views = self._views
        return all((v := views.get(url)) is not None and v.available for url in urls)

    def _known_pop(self, name: str) -> str:
        if name not in self._pops:
            raise RouterError(f"unknown PoP {name!r}; known: {', '.join(sorted(self._pops))}")
        return name

    def _known_daemon(self, url: str) -> DaemonState:
        state = self._daemons.get(normalize_url(url))
        if state is None:
            raise RouterError(f"unknown daemon {url!r}; known: {', '.join(sorted(self._daemons))}")
        return state

    def _build_view(self, d: DaemonState, now: float) -> DaemonView:
        hb, pop = d.heartbeat, self._pops[d.pop]
        checks: list[tuple[DaemonStateCode, bool, str]] = [
            ("no_heartbeat", hb is None, "no heartbeat yet"),
            ("stale", not d.fresh(now, self.heartbeat_interval_s), "heartbeats stopped"),
            ("down", d.down_since is not None, "connection failed; waiting for a heartbeat"),
            ("admin_drained", d.admin_drained, "drained by admin"),
            ("pop_drained", d.pop in self._drained_pops, "PoP drained by admin"),
        ]
        if hb is not None:
            checks += [
                ("draining", hb.draining or hb.drained, "draining"),
                ("kv_full", hb.kv_blocks_free == 0, "KV cache full"),
                ("no_kv_endpoint", hb.role == "prefill" and not hb.kv_endpoint, "no kv_endpoint"),
            ]
        # Checks run in order of how fundamental they are; the first failure names the state.
        up: tuple[DaemonStateCode, str | None] = ("up", None)
        state, reason = next(((c, why) for c, bad, why in checks if bad), up)
        # Before the first heartbeat the load fields read as an empty daemon (never placeable).
        load = {f: getattr(hb, f) for f in _FROM_HEARTBEAT} if hb else _NO_HEARTBEAT
        return DaemonView(
            url=d.url,
            pop=d.pop,
            lat=pop.lat,
            lon=pop.lon,
            **load,
            draining=bool(hb and (hb.draining or hb.drained)),
            admin_drained=d.admin_drained or d.pop in self._drained_pops,
            last_seen=d.last_seen,
            rtt_s=self._rtt.get(d.pop),
            available=state == "up",
            state=state,
            reason=reason,
        )


def _identity(hb: Heartbeat) -> tuple[object, ...]:
    """The heartbeat fields that decide whether and for what a daemon can be placed."""
    return (hb.role, hb.model, hb.kv_endpoint, hb.draining, hb.drained, hb.kv_blocks_free == 0)


# DaemonView fields copied verbatim from the latest heartbeat, and their values before one.
_NO_HEARTBEAT: dict[str, Any] = {
    "role": None, "model": None, "kv_endpoint": None, "running": 0, "waiting": 0,
    "kv_blocks_free": 0, "kv_blocks_total": 0, "block_size": 1, "prefill_tokens_per_s": 0.0,
    "decode_tokens_per_s": 0.0, "ttft_p50_s": None, "itl_p50_s": None,
    "queued_prefill_tokens": 0, "in_flight": 0, "kv_bytes_per_token": 1,
    "local_prefill_threshold": 0, "prefill_chunk_tokens": 1, "tokenizer_id": None,
}  # fmt: skip
_FROM_HEARTBEAT = tuple(_NO_HEARTBEAT)
