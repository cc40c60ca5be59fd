"""Structured logging: one line per event in every format, colour only on a terminal."""

from __future__ import annotations

import io
import json
import logging
import sys

import pytest

from edgeinfer.shared.logs import LogFormat, configure_logging, make_formatter, wants_colour


def record(msg: str, *, exc: bool = False, **extra: object) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("bad\nthing")
        except ValueError:
            exc_info = sys.exc_info()
    rec = logging.LogRecord("edgeinfer.test", logging.WARNING, __file__, 1, msg, None, exc_info)
    rec.__dict__.update(extra)
    return rec


@pytest.mark.parametrize("fmt", ["text", "kv", "json"])
def test_every_format_keeps_an_event_on_one_line(fmt: LogFormat) -> None:
    line = make_formatter(fmt).format(record("two\nlines", exc=True))
    assert "\n" not in line and "\x1b" not in line
    assert "ValueError" in line  # the traceback is there, folded


def test_kv_quotes_and_keeps_extra_fields() -> None:
    line = make_formatter("kv").format(record('say "hi" a=b', request_id="r-1", n=3))
    assert line.split(" ", 1)[0].startswith("ts=") and "level=warning" in line
    assert 'msg="say \\"hi\\" a=b"' in line
    assert line.endswith("request_id=r-1 n=3")


def test_json_is_one_object_per_line() -> None:
    obj = json.loads(make_formatter("json").format(record("x", request_id="r-1", exc=True)))
    assert (obj["level"], obj["logger"], obj["msg"]) == ("warning", "edgeinfer.test", "x")
    assert obj["request_id"] == "r-1" and "ValueError" in obj["exc"]


def test_colour_only_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    assert wants_colour(Tty()) and not wants_colour(io.StringIO())
    assert "\x1b[33m" in make_formatter("text", colour=True).format(record("x"))
    monkeypatch.setenv("NO_COLOR", "1")
    assert not wants_colour(Tty())


def test_configure_logging_reconfigures_only_its_own_handler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    monkeypatch.setattr(root, "level", root.level)
    out = io.StringIO()
    assert configure_logging("info", "kv", out)
    logging.getLogger("edgeinfer.x").debug("hidden")
    assert configure_logging("debug", "json", out)  # a reload: same handler, new format
    logging.getLogger("edgeinfer.x").debug("shown")
    assert len(root.handlers) == 1
    assert [json.loads(ln)["msg"] for ln in out.getvalue().splitlines()] == ["shown"]

    monkeypatch.setattr(root, "handlers", [logging.NullHandler()])
    assert not configure_logging("info", "kv")  # someone else owns logging: left alone
