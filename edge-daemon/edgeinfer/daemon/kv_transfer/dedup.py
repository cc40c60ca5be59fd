"""Per-request sequence tracking: drop replayed, duplicate and late messages.

A peer may resend after a reconnect, and a message may arrive after its request was finished or
aborted; applying either would write KV into blocks that now belong to another request. Every
message carries ``(rid, seq)`` (see :mod:`.wire`), and :class:`DuplicateFilter` accepts each
pair at most once and nothing for a finished request.

Memory is bounded on every axis, because the peer, not us, decides how many ids and sequence
numbers it sends:

* at most ``max_active`` requests are tracked; the least recently seen is forgotten first (a
  request silent that long has been timed out by the daemon anyway);
* at most ``max_finished`` finished ids are remembered, least recently finished forgotten first;
* per request, seqs below a watermark cost nothing, and at most ``max_out_of_order`` seqs above
  it are held; a seq beyond that is refused rather than stored.
"""

from __future__ import annotations

from collections import OrderedDict


class _SeqWindow:
    """Seen seqs of one request: all of ``[0, low)`` plus the set ``above``."""

    __slots__ = ("above", "low")

    def __init__(self) -> None:
        self.low = 0
        self.above: set[int] = set()


class DuplicateFilter:
    """Accept each ``(rid, seq)`` once; refuse everything for finished requests."""

    def __init__(
        self, *, max_active: int = 4096, max_finished: int = 65536, max_out_of_order: int = 1024
    ) -> None:
        if min(max_active, max_finished, max_out_of_order) < 1:
            raise ValueError("DuplicateFilter bounds must all be >= 1")
        self._max_active = max_active
        self._max_finished = max_finished
        self._max_out_of_order = max_out_of_order
        self._active: OrderedDict[str, _SeqWindow] = OrderedDict()
        self._finished: OrderedDict[str, None] = OrderedDict()

    def accept(self, rid: str, seq: int) -> bool:
        """True the first time ``(rid, seq)`` is seen while ``rid`` is not finished."""
        if seq < 0 or rid in self._finished:
            return False
        window = self._active.get(rid)
        if window is None:
            window = self._active[rid] = _SeqWindow()
            if len(self._active) > self._max_active:
                self._active.popitem(last=False)
        else:
            self._active.move_to_end(rid)
        if seq < window.low or seq in window.above:
            return False
        if seq > window.low and len(window.above) >= self._max_out_of_order:
            return False
        window.above.add(seq)
        # Slide the watermark so an in-order stream keeps `above` empty.
        while window.low in window.above:
            window.above.remove(window.low)
            window.low += 1
        return True

    def finish(self, rid: str) -> None:
        """Mark ``rid`` done (completed, aborted or failed): later messages for it are refused."""
        self._active.pop(rid, None)
        self._finished[rid] = None
        self._finished.move_to_end(rid)
        if len(self._finished) > self._max_finished:
            self._finished.popitem(last=False)

    def is_finished(self, rid: str) -> bool:
        return rid in self._finished

    @property
    def active(self) -> int:
        """Number of requests currently tracked (for a gauge metric)."""
        return len(self._active)
