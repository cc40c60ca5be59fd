"""Typed access to a JSON request body: each getter returns the default for a missing or null
field and raises a 400 naming the field when the value has the wrong type."""

from __future__ import annotations

from typing import Any, overload

from edgeinfer.daemon.api.errors import APIError

PREFILL_HEADER = "x-edge-prefill"

# ZeroMQ transports a prefill daemon can be reached over.
_ENDPOINT_SCHEMES = ("tcp://", "ipc://")


class Fields:
    def __init__(self, body: dict[str, Any], prefix: str = "") -> None:
        self.body = body
        self._prefix = prefix  # "stream_options." for nested objects, so errors name the path

    def _bad(self, name: str, expected: str) -> APIError:
        value = self.body[name]
        param = self._prefix + name
        return APIError(400, f"{param} must be {expected}, got {type(value).__name__}", param=param)

    def text(self, name: str) -> str | None:
        value = self.body.get(name)
        if value is None or isinstance(value, str):
            return value
        raise self._bad(name, "a string")

    @overload
    def integer(self, name: str, default: int) -> int: ...
    @overload
    def integer(self, name: str, default: None) -> int | None: ...
    def integer(self, name: str, default: int | None) -> int | None:
        value = self.body.get(name)
        if value is None:
            return default
        # bool is an int subclass; `n: true` is a client bug, not 1.
        if type(value) is int:
            return value
        raise self._bad(name, "an integer")

    def flag(self, name: str, default: bool) -> bool:
        value = self.body.get(name)
        if value is None:
            return default
        if isinstance(value, bool):
            return value
        raise self._bad(name, "a boolean")

    def object(self, name: str) -> dict[str, Any] | None:
        value = self.body.get(name)
        if value is None or isinstance(value, dict):
            return value
        raise self._bad(name, "an object")


def prefill_endpoint_value(value: str | None, param: str) -> str | None:
    """A prefill daemon's ZeroMQ endpoint as a request names it (``param`` says where), checked
    for shape only: whether it may be used is :mod:`~edgeinfer.daemon.api.caller`'s call."""
    if value is None:
        return None
    endpoint = value.strip()
    if not endpoint.startswith(_ENDPOINT_SCHEMES) or len(endpoint) > 256:
        raise APIError(400, f"{param} must be a ZeroMQ endpoint like tcp://host:port", param=param)
    return endpoint
