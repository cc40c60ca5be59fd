"""Process logging: one line per event, as text, ``key=value`` pairs or JSON, for journald.

Every format keeps an event on one line (a traceback is folded into an escaped ``exc`` field),
because journald and most log shippers split on newlines and a multi-line traceback would
become a dozen unrelated entries. In ``kv`` and ``json``, fields passed with ``extra={...}``
come out as their own keys. ANSI colours appear only in the text format and only on a
terminal (never under journald, in a file or with ``NO_COLOR`` set).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import UTC, datetime
from typing import Any, Literal, TextIO

from edgeinfer.shared.request_ids import add_request_id_filter

LogFormat = Literal["text", "json", "kv"]


# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "taskName",
}
_COLOURS = {
    "DEBUG": "\x1b[2m",
    "WARNING": "\x1b[33m",
    "ERROR": "\x1b[31m",
    "CRITICAL": "\x1b[1;31m",
}
_RESET = "\x1b[0m"
_MARK = "_edgeinfer_handler"  # tags the handler we own, so a reload replaces only ours


class _OneLine(logging.Formatter):
    """Collects an event's fields; subclasses only choose how to print them."""

    def fields(self, record: logging.LogRecord) -> dict[str, Any]:
        ts = datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
        out: dict[str, Any] = {
            "ts": ts.replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out.setdefault(key, value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return out


class KeyValueFormatter(_OneLine):
    """``ts=... level=info logger=edgeinfer.daemon msg="listening on ..."`` (logfmt)."""

    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{k}={_kv_value(v)}" for k, v in self.fields(record).items())


class JsonFormatter(_OneLine):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(self.fields(record), default=str, ensure_ascii=False)


class TextFormatter(_OneLine):
    """``2024-05-01T12:00:00.000Z INFO edgeinfer.daemon: message key=value``, for people."""

    def __init__(self, colour: bool) -> None:
        super().__init__()
        self.colour = colour

    def format(self, record: logging.LogRecord) -> str:
        fields = self.fields(record)
        level = record.levelname
        if self.colour and level in _COLOURS:
            level = f"{_COLOURS[level]}{level}{_RESET}"
        line = f"{fields['ts']} {level} {fields['logger']}: {_escape(fields['msg'])}"
        # Extras (aiohttp's access log sends a dozen) only repeat the message for a reader;
        # the machine formats keep them. The request id and a traceback still go on the line.
        for key in ("request_id", "exc", "stack"):
            if key in fields:
                line += f" {key}={_kv_value(fields[key])}"
        return line


def make_formatter(fmt: LogFormat, *, colour: bool = False) -> logging.Formatter:
    if fmt == "json":
        return JsonFormatter()
    if fmt == "kv":
        return KeyValueFormatter()
    return TextFormatter(colour)


def wants_colour(stream: TextIO) -> bool:
    """Colour only for a person at a terminal (https://no-color.org and TERM=dumb respected)."""
    if "NO_COLOR" in os.environ or os.environ.get("TERM") == "dumb":
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def configure_logging(level: str, fmt: LogFormat, stream: TextIO | None = None) -> bool:
    """Log ``level`` and above to ``stream`` (stderr) in ``fmt``; call again to reload.

    Like :func:`logging.basicConfig`, this leaves a root logger that someone else already
    configured (pytest, an application embedding us) alone, and then returns False.
    """
    root = logging.getLogger()
    ours = [h for h in root.handlers if getattr(h, _MARK, False)]
    if ours:
        handler = ours[0]
    elif root.handlers:
        return False
    else:
        handler = logging.StreamHandler(stream or sys.stderr)
        setattr(handler, _MARK, True)
        root.addHandler(handler)
    add_request_id_filter(handler)
    target = getattr(handler, "stream", None) or sys.stderr
    handler.setFormatter(make_formatter(fmt, colour=wants_colour(target)))
    root.setLevel(level.upper())
    return True


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


def _kv_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    text = _escape(text)
    if text == "" or any(c in text for c in ' "='):
        return '"' + text.replace('"', '\\"') + '"'
    return text
