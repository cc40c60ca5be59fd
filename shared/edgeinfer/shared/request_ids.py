"""Request ids: one id per client request, carried router -> daemon and stamped on log lines.

The router takes the client's ``X-Request-Id`` when it is a sane token, else makes one; it sends
it to the daemon, which keeps it. Either process binds the id to the handling task with
:func:`bind_request_id`; :class:`RequestIdFilter` then stamps it on every log record made while
that request is handled (aiohttp runs each request in its own task, so a binding never leaks into
the next request on a keep-alive connection). ``configure_logging`` installs the filter on the
process's log handler.
"""

from __future__ import annotations

import logging
import re
import uuid
from contextvars import ContextVar, Token

REQUEST_ID_HEADER = "X-Request-Id"

# Printable, log-safe and header-safe: no spaces, quotes, '=' or control characters, so an id
# can be written unquoted into a key=value log line and cannot forge another field.
_VALID = re.compile(r"[A-Za-z0-9._:-]{1,128}")

_current: ContextVar[str | None] = ContextVar("edgeinfer_request_id", default=None)


def valid_request_id(value: str | None) -> bool:
    """True for 1-128 characters of ``[A-Za-z0-9._:-]`` (what we accept from a client)."""
    return value is not None and _VALID.fullmatch(value) is not None


def new_request_id() -> str:
    return uuid.uuid4().hex


def request_id_from(value: str | None) -> str:
    """The client's id when it is valid, else a fresh one."""
    return value if value is not None and valid_request_id(value) else new_request_id()


def bind_request_id(request_id: str | None) -> Token[str | None]:
    """Make ``request_id`` the current one for this task (and tasks it starts)."""
    return _current.set(request_id)


def unbind_request_id(token: Token[str | None]) -> None:
    _current.reset(token)


def current_request_id() -> str | None:
    return _current.get()


class RequestIdFilter(logging.Filter):
    """Stamps the current request's id on a record as ``request_id`` (kept when already set)."""

    def filter(self, record: logging.LogRecord) -> bool:
        request_id = _current.get()
        if request_id is not None and not hasattr(record, "request_id"):
            record.request_id = request_id
        return True


def add_request_id_filter(handler: logging.Handler) -> None:
    """Install :class:`RequestIdFilter` on ``handler`` once (a reload calls this again)."""
    if not any(isinstance(f, RequestIdFilter) for f in handler.filters):
        handler.addFilter(RequestIdFilter())
