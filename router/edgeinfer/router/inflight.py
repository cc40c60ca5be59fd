"""Placements this router made that the daemons' heartbeats do not show yet.

A heartbeat is a picture of a daemon's load. Between two of them every decision would price the
same picture and send the next seconds of traffic to the same few cheapest daemons, so the
router adds to each daemon's reported load what it has placed there since: a sequence and its
KV (prompt + ``max_tokens``) on the decode daemon, the prompt's tokens on whichever daemon
prefills it.

A placement stops counting once a heartbeat that includes it has arrived. A heartbeat received
at ``t`` includes a placement made at ``t0`` if the request reached the daemon and the daemon's
load snapshot was taken after that: the request needs ``lag`` (the way there, and for the
prefill daemon the decode daemon's admission and the hop on; the heartbeat's way back is the
same length again), and the daemon refreshes its snapshot every ``report_lag_s`` (half a period,
``edgeinfer.daemon.load_report``), so the snapshot's age is uniform in [0, report_lag_s). The
probability that the heartbeat includes the placement is therefore
``clamp((t - t0 - lag) / report_lag_s, 0, 1)``, and the placement keeps counting with the rest:
its weight is the chance that no heartbeat so far has shown it. Counting it longer would count
it twice; dropping it at the first heartbeat would lose the ones still on their way.

Each router knows only its own placements: with several routers behind anycast each corrects
for its share of the traffic, and the two-random-choices tie-break in the selector covers the
rest. The selector reads the totals when it builds its arrays for a snapshot and the journal of
changes since then per decision (``version``, :meth:`changes_since`).

The ledger also keeps, per decode daemon, how many requests this router sent it lately (each
weighted ``exp(-age / RECENT_S)``, :meth:`recent`): the share of recent traffic a daemon took,
which breaks the prefix path's ties when loads are equal. With a few requests in flight, loads
are small counts and often equal, and a conversation stays where its first turn went, so a
first turn placed by load alone can leave one daemon with twice another's conversations.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence

# One change to a daemon's pending load: url, sequences, KV tokens, prefill tokens, and when.
Change = tuple[str, float, float, float, float]
# recent()'s time constant: long beside a request (the count is a share of traffic, not what is
# in flight), short beside a deployment's traffic shifts.
RECENT_S = 60.0
# Readers trim the journal as they catch up (trim_to); this bounds it when none does.
MAX_JOURNAL = 100_000


@dataclasses.dataclass(slots=True, eq=False)
class _Entry:
    url: str
    placed_at: float
    lag_s: float  # until the request is at the daemon and a heartbeat can be back
    seqs: int
    kv_tokens: int
    prefill_tokens: int
    prefill_s: float  # the prefill's compute time at its daemon's rate
    weight: float = 1.0  # probability that no heartbeat so far has included it


@dataclasses.dataclass(frozen=True, slots=True)
class Ticket:
    """One recorded placement, to :meth:`PlacementLedger.cancel` if it never reached a daemon."""

    entries: tuple[_Entry, ...]


class PlacementLedger:
    def __init__(self, report_lag_s: float) -> None:
        self.report_lag_s = report_lag_s
        self._entries: dict[str, list[_Entry]] = {}
        self._totals: dict[str, list[float]] = {}  # url -> [seqs, kv tokens, prefill tokens]
        # url -> when its pending prefill work would be done, had it nothing else to do.
        self._ends: dict[str, float] = {}
        self._journal: list[Change] = []
        self._base = 0  # version of the first journal entry kept
        self._now = 0.0  # the latest time any caller told us
        self._recent: dict[str, tuple[float, float]] = {}  # decode url -> (count, as of when)

    @property
    def version(self) -> int:
        return self._base + len(self._journal)

    def totals(self, url: str) -> Sequence[float]:
        """Pending (sequences, KV tokens, prefill tokens) of ``url``, all 0 when none."""
        return self._totals.get(url, _ZERO)

    def items(self) -> Iterator[tuple[str, Sequence[float], float]]:
        """Every daemon with something pending: url, :meth:`totals`, :meth:`prefill_end`."""
        ends = self._ends
        for url, t in self._totals.items():
            yield url, t, ends.get(url, -math.inf)

    def prefill_end(self, url: str) -> float:
        """When ``url`` would finish the pending prefills alone, each started when placed: a
        daemon works them off as the seconds pass, so pending tokens are not all still queued.
        (-inf when none.) Behind the reported queue they end later, if at all
        (:func:`edgeinfer.router.load_arrays.queue_end`)."""
        return self._ends.get(url, -math.inf)

    def recent(self, url: str, now: float) -> float:
        """Requests this router placed on decode daemon ``url``, each weighted by
        ``exp(-age / RECENT_S)`` (0.0 for one it never used)."""
        r = self._recent.get(url)
        if r is None:
            return 0.0
        count, at = r
        return count * math.exp((at - now) / RECENT_S) if now > at else count

    def changes_since(self, version: int) -> list[Change] | None:
        """Changes after ``version``; None if the journal was trimmed past it (rebuild)."""
        if version < self._base:
            return None
        return self._journal[version - self._base :]

    def trim(self) -> None:
        """Drop the journal: readers older than now rebuild from :meth:`totals`."""
        self._base = self.version
        self._journal.clear()

    def trim_to(self, version: int) -> None:
        """Drop the changes before ``version``: no reader older than it is left."""
        if version > self._base:
            del self._journal[: version - self._base]
            self._base = version

    def record(
        self,
        now: float,
        decode: str,
        prefill: str | None,
        prompt_tokens: int,
        kv_tokens: int,
        decode_lag_s: float,
        prefill_lag_s: float,
        prefill_s: float,
    ) -> Ticket:
        """A request was sent to ``decode`` (prefilled by ``prefill``, None: by ``decode``)."""
        self._now = max(self._now, now)
        entries: tuple[_Entry, ...]
        if prefill is None or prefill == decode:
            entries = (_Entry(decode, now, decode_lag_s, 1, kv_tokens, prompt_tokens, prefill_s),)
        else:
            entries = (
                _Entry(decode, now, decode_lag_s, 1, kv_tokens, 0, 0.0),
                _Entry(prefill, now, prefill_lag_s, 0, 0, prompt_tokens, prefill_s),
            )
        prev = self._recent.get(decode)
        at = now if prev is None or now > prev[1] else prev[1]  # times may arrive out of order
        self._recent[decode] = (self.recent(decode, at) + 1.0, at)
        for e in entries:
            self._entries.setdefault(e.url, []).append(e)
            self._add(e, 1.0)
            if e.prefill_s:
                self._ends[e.url] = max(self._ends.get(e.url, -math.inf), now) + e.prefill_s
        return Ticket(entries)

    def cancel(self, ticket: Ticket) -> None:
        """The request never got there (connect failure) or was refused (a 503)."""
        for e in ticket.entries:
            if e.seqs and (r := self._recent.get(e.url)) is not None:
                at = max(r[1], self._now)
                gone = math.exp((e.placed_at - at) / RECENT_S)
                self._recent[e.url] = (max(0.0, self.recent(e.url, at) - gone), at)
            mine = self._entries.get(e.url, [])
            if e in mine:  # identity (eq=False); a heartbeat may already have absorbed it
                mine.remove(e)
                self._add(e, -e.weight)
                if not mine:
                    self.forget(e.url)
                else:
                    self._replay(e.url, mine)

    def absorb(self, url: str, now: float) -> None:
        """A heartbeat of ``url`` arrived at ``now``: what it probably includes stops counting."""
        self._now = max(self._now, now)
        mine = self._entries.get(url)
        if not mine:
            return
        lag = self.report_lag_s
        kept = []
        for e in mine:
            age = now - e.placed_at - e.lag_s
            shown = 1.0 if age >= lag else (max(0.0, age) / lag if lag > 0 else 0.0)
            weight = min(e.weight, 1.0 - shown)
            if weight < 1e-9:  # float dust of a subtraction of times: shown for sure
                weight = 0.0
            if weight < e.weight:
                self._add(e, weight - e.weight)
                e.weight = weight
            if weight > 0.0:
                kept.append(e)
        self._entries[url] = kept
        if not kept:
            self.forget(url)
        else:
            self._replay(url, kept)

    def forget(self, url: str) -> None:
        """Nothing pending on ``url`` any more: it restarted (its work is lost) or was removed."""
        self._entries.pop(url, None)
        self._ends.pop(url, None)
        t = self._totals.pop(url, None)
        # The exact remainder, so that no float dust is left: an idle daemon reads idle.
        if t is not None and any(t):
            self._journal.append((url, -t[0], -t[1], -t[2], self._now))

    def _replay(self, url: str, entries: list[_Entry]) -> None:
        end = -math.inf
        for e in entries:  # in placement order
            if e.prefill_s:
                end = max(end, e.placed_at) + e.weight * e.prefill_s
        self._ends[url] = end

    def _add(self, e: _Entry, w: float) -> None:
        t = self._totals.setdefault(e.url, [0.0, 0.0, 0.0])
        change = (e.url, w * e.seqs, w * e.kv_tokens, w * e.prefill_tokens, self._now)
        t[0] += change[1]
        t[1] += change[2]
        t[2] += change[3]
        self._journal.append(change)
        if len(self._journal) > MAX_JOURNAL:  # no reader kept up (none asked): they rebuild
            self.trim()


_ZERO = (0.0, 0.0, 0.0)
