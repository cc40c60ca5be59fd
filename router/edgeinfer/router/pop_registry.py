"""What the router knows about every PoP and daemon: configuration, heartbeats, admin state.

The registry is the single writer of that state (heartbeat listener, proxy, admin API, RTT prober
all go through it) and :meth:`PopRegistry.snapshot` is the readers' view: a list of immutable
:class:`DaemonView`. The same list object is returned until something changes (callers must not
mutate it), so the selector can cache its per-snapshot arrays on identity; and only daemons that
changed get a new view: at 600 daemons heartbeating every 5 s that is ~120 cheap rebuilds a
second, not 120 full ones.

Time is always passed in (``now``, monotonic seconds) so tests can drive it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable, Sequence
from typing import Literal

from edgeinfer.router.errors import RouterError
from edgeinfer.shared.heartbeat import Heartbeat, Role

# A daemon silent for this many heartbeat periods is out until it speaks again: one lost
# heartbeat is noise, three in a row is a dead process or a partition.
STALE_PERIODS = 3

UpdateResult = Literal["accepted", "restart", "unknown_daemon", "pop_mismatch", "out_of_order"]
# DaemonView.state: "up", or why the daemon gets nothing new (stable codes for tools).
DaemonStateCode = Literal[
    "up",
    "no_heartbeat",
    "stale",
    "down",
    "admin_drained",
    "pop_drained",
    "draining",
    "kv_full",
    "no_kv_endpoint",
]


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
        if not (math.isfinite(self.lat) and -90 <= self.lat <= 90):
            raise RouterError(f"PoP {self.name!r}: lat {self.lat} not in [-90, 90]")
        if not (math.isfinite(self.lon) and -180 <= self.lon <= 180):
            raise RouterError(f"PoP {self.name!r}: lon {self.lon} not in [-180, 180]")
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
    draining: bool
    admin_drained: bool
    last_seen: float | None  # monotonic time of the last accepted heartbeat
    rtt_s: float | None  # this router's measured RTT EWMA to the daemon's PoP
    available: bool  # may receive new requests
    state: DaemonStateCode  # "up" when available, else the first reason code
    reason: str | None  # why not, in words, when not available


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
        *,
        rtt_alpha: float = 0.3,
    ) -> None:
        if heartbeat_interval_s <= 0:
            raise RouterError(f"heartbeat_interval_s must be > 0, got {heartbeat_interval_s}")
        self.here = here
        self.heartbeat_interval_s = heartbeat_interval_s
        self.rtt_alpha = rtt_alpha
        self._pops: dict[str, PopConfig] = {}
        self._daemons: dict[str, DaemonState] = {}
        self._drained_pops: set[str] = set()
        self._rtt: dict[str, float] = {}
        self._views: dict[str, DaemonView] = {}
        self._dirty: set[str] = set()
        self._snapshot: list[DaemonView] | None = None
        self._valid: tuple[float, float] = (0.0, 0.0)  # [built at, first freshness expiry)
        self.replace_pops(pops)

    # ---- configuration ----

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
                    raise RouterError(
                        f"daemon {url!r} is listed in PoPs {owner[url]!r} and {pop.name!r}"
                    )
                owner[url] = pop.name
        old = self._daemons
        self._daemons = {
            url: dataclasses.replace(old[url], pop=pop) if url in old else DaemonState(url, pop)
            for url, pop in owner.items()
        }
        self._pops = table
        self._drained_pops &= table.keys()
        self._rtt = {name: rtt for name, rtt in self._rtt.items() if name in table}
        self._views.clear()
        self._dirty = set(self._daemons)
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

    # ---- writers ----

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
        result: UpdateResult = (
            "restart" if prev is not None and hb.started_at != prev.started_at else "accepted"
        )
        state.heartbeat, state.last_seen, state.down_since = hb, now, None
        self._dirty.add(state.url)
        return result

    def mark_down(self, url: str, now: float) -> None:
        """Take a daemon out after a connect error, until its next heartbeat."""
        state = self._daemons.get(normalize_url(url))
        # The proxy may report a daemon that a reload has just removed; nothing to do then.
        if state is not None:
            state.down_since = now
            self._dirty.add(state.url)

    def drain_pop(self, name: str) -> None:
        self._drained_pops.add(self._known_pop(name))
        self._dirty.update(self._pops[name].daemons)

    def undrain_pop(self, name: str) -> None:
        self._drained_pops.discard(self._known_pop(name))
        self._dirty.update(self._pops[name].daemons)

    def drain_daemon(self, url: str) -> None:
        self._known_daemon(url).admin_drained = True
        self._dirty.add(normalize_url(url))

    def undrain_daemon(self, url: str) -> None:
        self._known_daemon(url).admin_drained = False
        self._dirty.add(normalize_url(url))

    def record_rtt(self, pop: str, seconds: float) -> None:
        # A probe can finish after a reload removed its PoP; its result is then moot.
        if pop not in self._pops or not math.isfinite(seconds) or seconds < 0:
            return
        prev = self._rtt.get(pop)
        self._rtt[pop] = seconds if prev is None else prev + self.rtt_alpha * (seconds - prev)
        self._dirty.update(self._pops[pop].daemons)

    # ---- readers ----

    def rtt(self, pop: str) -> float | None:
        return self._rtt.get(self._known_pop(pop))

    def in_flight(self, pop: str, now: float | None = None) -> int:
        """Requests in flight in a PoP, per its daemons' fresh heartbeats (a dead daemon's last
        count would otherwise linger)."""
        now = time.monotonic() if now is None else now
        states = (self._daemons[url] for url in self._pops[self._known_pop(pop)].daemons)
        return sum(
            d.heartbeat.in_flight
            for d in states
            if d.heartbeat is not None and d.fresh(now, self.heartbeat_interval_s)
        )

    def snapshot(self, now: float) -> list[DaemonView]:
        built_at, expires_at = self._valid
        if self._snapshot is not None and not self._dirty and built_at <= now < expires_at:
            return self._snapshot
        # A freshness deadline passed (or time ran backwards): every view may have changed.
        stale = self._snapshot is None or not built_at <= now < expires_at
        for url in self._daemons if stale else self._dirty:
            self._views[url] = self._build_view(self._daemons[url], now)
        self._dirty.clear()
        period = STALE_PERIODS * self.heartbeat_interval_s
        deadlines = (
            d.last_seen + period
            for d in self._daemons.values()
            if d.last_seen is not None and d.fresh(now, self.heartbeat_interval_s)
        )
        # The cached tuple stays valid until the first fresh daemon could go stale.
        self._valid = (now, min(deadlines, default=math.inf))
        self._snapshot = [self._views[url] for url in self._daemons]
        return self._snapshot

    # ---- internals ----

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
        state, reason = _first_failure(
            (
                ("no_heartbeat", hb is None, "no heartbeat yet"),
                (
                    "stale",
                    not d.fresh(now, self.heartbeat_interval_s),
                    f"silent for over {STALE_PERIODS} heartbeat periods",
                ),
                ("down", d.down_since is not None, "connection failed; waiting for a heartbeat"),
                ("admin_drained", d.admin_drained, "drained by admin"),
                ("pop_drained", d.pop in self._drained_pops, "PoP drained by admin"),
                ("draining", hb is not None and (hb.draining or hb.drained), "draining"),
                ("kv_full", hb is not None and hb.kv_blocks_free == 0, "KV cache full"),
                (
                    "no_kv_endpoint",
                    hb is not None and hb.role == "prefill" and hb.kv_endpoint is None,
                    "prefill daemon without kv_endpoint",
                ),
            )
        )
        return DaemonView(
            url=d.url,
            pop=d.pop,
            lat=pop.lat,
            lon=pop.lon,
            role=hb.role if hb else None,
            model=hb.model if hb else None,
            kv_endpoint=hb.kv_endpoint if hb else None,
            running=hb.running if hb else 0,
            waiting=hb.waiting if hb else 0,
            kv_blocks_free=hb.kv_blocks_free if hb else 0,
            kv_blocks_total=hb.kv_blocks_total if hb else 0,
            block_size=hb.block_size if hb else 1,
            prefill_tokens_per_s=hb.prefill_tokens_per_s if hb else 0.0,
            decode_tokens_per_s=hb.decode_tokens_per_s if hb else 0.0,
            ttft_p50_s=hb.ttft_p50_s if hb else None,
            itl_p50_s=hb.itl_p50_s if hb else None,
            queued_prefill_tokens=hb.queued_prefill_tokens if hb else 0,
            in_flight=hb.in_flight if hb else 0,
            draining=bool(hb and (hb.draining or hb.drained)),
            admin_drained=d.admin_drained or d.pop in self._drained_pops,
            last_seen=d.last_seen,
            rtt_s=self._rtt.get(d.pop),
            available=state == "up",
            state=state,
            reason=reason,
        )


def _first_failure(
    checks: Iterable[tuple[DaemonStateCode, bool, str]],
) -> tuple[DaemonStateCode, str | None]:
    """The first failing check, in order of how fundamental it is; ("up", None) if none fails."""
    return next(((code, why) for code, failed, why in checks if failed), ("up", None))
