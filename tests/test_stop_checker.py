"""StopChecker: hold-back of partial stops, exact cuts, split invariance (hypothesis)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgeinfer.daemon.engine.stop_checker import StopChecker


def reference(text: str, stops: list[str], include: bool) -> tuple[str, bool]:
    """One-shot answer by brute force: the first position where any stop is complete."""
    for end in range(1, len(text) + 1):
        # Among stops completed at `end`, the longest starts first.
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            return (text[:end] if include else text[: end - len(stop)]), True
    return text, False


def stream(text: str, cuts: list[int], stops: list[str], include: bool) -> list[str]:
    """Feed ``text`` split at ``cuts``; the emitted pieces, flush included when no stop."""
    checker = StopChecker(stops, include)
    bounds = [0, *sorted(set(cuts)), len(text)]
    pieces = []
    for a, b in itertools.pairwise(bounds):
        out, hit = checker.feed(text[a:b])
        pieces.append(out)
        if hit:
            return pieces
    pieces.append(checker.flush())
    return pieces


def test_passthrough_without_stops() -> None:
    checker = StopChecker([], include_stop_str_in_output=False)
    assert checker.feed("hello") == ("hello", False)
    assert checker.flush() == ""


def test_holds_back_partial_stop_and_cuts_across_deltas() -> None:
    checker = StopChecker(["</end>"], include_stop_str_in_output=False)
    assert checker.feed("abc</e") == ("abc", False)
    assert checker.feed("n") == ("", False)
    assert checker.feed("d>tail") == ("", True)
    assert checker.stopped and checker.stop_str == "</end>"
    assert checker.feed("more") == ("", True)
    assert checker.flush() == ""


def test_false_alarm_is_released() -> None:
    checker = StopChecker(["STOP"], include_stop_str_in_output=False)
    assert checker.feed("xST") == ("x", False)
    assert checker.feed("OP!") == ("", True)
    checker = StopChecker(["STOP"], include_stop_str_in_output=False)
    assert checker.feed("xST") == ("x", False)
    assert checker.feed("ay") == ("STay", False)


def test_include_stop_string() -> None:
    checker = StopChecker(["\n\n"], include_stop_str_in_output=True)
    assert checker.feed("one\n") == ("one", False)
    assert checker.feed("\ntwo") == ("\n\n", True)


def test_flush_returns_held_tail() -> None:
    checker = StopChecker(["abc"], include_stop_str_in_output=False)
    assert checker.feed("zzab") == ("zz", False)
    assert checker.flush() == "ab"


def test_earliest_completion_wins() -> None:
    # "bc" completes before "abcd" although "abcd" starts first.
    checker = StopChecker(["abcd", "bc"], include_stop_str_in_output=True)
    assert checker.feed("xabcd") == ("xabc", True)
    assert checker.stop_str == "bc"
    # Same end: the longer (earlier-starting) stop is reported.
    checker = StopChecker(["c", "abc"], include_stop_str_in_output=False)
    assert checker.feed("xabc") == ("x", True)
    assert checker.stop_str == "abc"


def test_rejects_empty_stop() -> None:
    with pytest.raises(ValueError):
        StopChecker([""], include_stop_str_in_output=False)


alphabet = st.sampled_from("ab\nc")


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet, max_size=30),
    stops=st.lists(st.text(alphabet, min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=10),
    include=st.booleans(),
)
def test_split_invariance(text: str, stops: list[str], cuts: list[int], include: bool) -> None:
    cuts = [c for c in cuts if c <= len(text)]
    expected, _ = reference(text, stops, include)
    pieces = stream(text, cuts, stops, include)
    assert "".join(pieces) == expected
    # Every intermediate emission is a prefix of the final text: nothing emitted early
    # ever turns out to be part of a stop string.
    emitted = ""
    for piece in pieces:
        emitted += piece
        assert expected.startswith(emitted)
        if not include:
            assert not any(s in emitted for s in stops)
