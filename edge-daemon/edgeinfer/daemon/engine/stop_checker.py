"""Stop-string detection over streamed text deltas.

The detokenizer hands over text in arbitrary pieces; a stop string may straddle several.
:class:`StopChecker` emits text as early as it safely can: it holds back only the longest
tail that is still the beginning of some stop string, so a client never receives text that
later turns out to belong to a stop.

When several stop strings occur, the one that *ends* first wins (ties: the one that starts
first, i.e. the longer one). That is the first moment any stop string is complete in the
stream, so the result does not depend on how the text was split into deltas.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopChecker:
    """Feed text deltas; get back the text safe to emit and whether a stop string was hit."""

    __slots__ = ("_held", "_include", "_max_len", "_stops", "stop_str", "stopped")

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(dict.fromkeys(stop))  # de-duplicated, order kept
        self._include = include_stop_str_in_output
        self._max_len = max((len(s) for s in self._stops), default=0)
        # Text received but not emitted yet: a tail that may be the start of a stop string.
        self._held = ""
        self.stopped = False
        # The stop string that ended the text, for the finish reason / API response.
        self.stop_str: str | None = None

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add ``delta``; return (text to emit now, whether a stop string was reached).

        After a stop, further deltas are ignored and ``("", True)`` is returned.
        """
        if self.stopped:
            return "", True
        if not self._stops:
            return delta, False
        text = self._held + delta
        hit = self._first_stop(text)
        if hit is not None:
            start, stop = hit
            self.stopped, self.stop_str, self._held = True, stop, ""
            end = start + len(stop) if self._include else start
            return text[:end], True
        keep = self._partial_tail(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """Release held-back text when the sequence ends for another reason (length, EOS)."""
        held, self._held = self._held, ""
        return held

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        # The first occurrence of each stop is also its earliest end (one length per stop);
        # rank by (end, start) so the earliest completion wins and ties favour the longer.
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = text.find(stop)
            if start >= 0:
                candidate = (start + len(stop), start, stop)
                if best is None or candidate[:2] < best[:2]:
                    best = candidate
        return None if best is None else (best[1], best[2])

    def _partial_tail(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop."""
        for size in range(min(len(text), self._max_len - 1), 0, -1):
            tail = text[-size:]
            if any(stop.startswith(tail) for stop in self._stops):
                return size
        return 0
