"""Typed, bounded access to a decoded msgpack header.

msgpack hands back whatever the peer packed, so every field is read through :class:`HeaderReader`,
which checks type and range and raises :class:`~.errors.MalformedError` naming the field. It also
records which keys were read so that :meth:`HeaderReader.finish` can reject unknown ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from edgeinfer.daemon.kv_transfer.errors import MalformedError

V = TypeVar("V")

MAX_INT = (1 << 63) - 1  # every wire int is a non-negative int64: ids, sizes, CRCs
MAX_STR = 4096
MAX_RID = 256
_SCALARS = (type(None), bool, int, float, str)


class HeaderReader:
    """Reads fields of one header map; see the module docstring."""

    def __init__(self, header: object, where: str = "header") -> None:
        if not isinstance(header, dict):
            raise MalformedError(f"{where} is not a map")
        self._header: dict[str, Any] = header
        self._where = where
        self._read: set[str] = set()

    def _get(self, key: str) -> Any:
        if key not in self._header:
            raise MalformedError(f"{self._where} lacks field {key!r}")
        self._read.add(key)
        return self._header[key]

    def uint(self, key: str) -> int:
        return self.as_uint(key, self._get(key))

    def text(self, key: str) -> str:
        value = self._get(key)
        limit = MAX_RID if key == "rid" else MAX_STR
        if not isinstance(value, str) or len(value) > limit:
            raise MalformedError(f"field {key!r} must be a string of at most {limit} characters")
        return value

    def opt_text(self, key: str) -> str | None:
        """A string field a sender may leave out (one added to its version later)."""
        return self.text(key) if key in self._header else None

    def flag(self, key: str) -> bool:
        value = self._get(key)
        if not isinstance(value, bool):
            raise MalformedError(f"field {key!r} must be a boolean")
        return value

    def opt_float(self, key: str) -> float | None:
        value = self._get(key)
        return None if value is None else self.as_float(key, value)

    def uint_list(self, key: str) -> list[int]:
        return self.as_uint_list(key, self._get(key), None)

    def list_of(self, key: str, item: Callable[[str, Any], V]) -> list[V]:
        value = self._get(key)
        if not isinstance(value, list):
            raise MalformedError(f"field {key!r} must be a list")
        return [item(f"{key}[{i}]", v) for i, v in enumerate(value)]

    def submap(self, key: str) -> HeaderReader:
        return HeaderReader(self._get(key), where=f"field {key!r}")

    def sampling(self, key: str) -> dict[str, Any]:
        """A parameter map: values are scalars, lists of scalars or maps of str -> scalar."""
        value = self._get(key)
        if not isinstance(value, dict) or len(value) > 256:
            raise MalformedError(f"field {key!r} must be a map of at most 256 entries")
        for name, v in value.items():
            inner = v.values() if isinstance(v, dict) else v if isinstance(v, list) else (v,)
            if not all(isinstance(x, _SCALARS) for x in inner):
                raise MalformedError(f"field {key}.{name} holds a non-scalar value")
        return value

    def finish(self) -> None:
        """Reject keys nobody read: an unknown field means a peer speaking another dialect."""
        extra = self._header.keys() - self._read
        if extra:
            raise MalformedError(f"{self._where} has unknown fields {sorted(map(repr, extra))}")

    @staticmethod
    def as_uint(key: str, value: Any) -> int:
        # bool is an int subclass; a True where a size belongs is a bug on the other side.
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_INT:
            raise MalformedError(f"field {key!r} must be a non-negative int64")
        return value

    @staticmethod
    def as_float(key: str, value: Any) -> float:
        # An int is accepted because Python (and mypy) let a sender pass 0 where a float belongs.
        if not isinstance(value, float | int) or isinstance(value, bool):
            raise MalformedError(f"field {key!r} must be a number")
        return float(value)

    @staticmethod
    def as_uint_list(key: str, value: Any, max_len: int | None) -> list[int]:
        if not isinstance(value, list) or (max_len is not None and len(value) > max_len):
            raise MalformedError(f"field {key!r} must be a list of ints")
        return [HeaderReader.as_uint(key, v) for v in value]

    @staticmethod
    def as_logprob_pair(key: str, value: Any) -> tuple[int, float]:
        if not isinstance(value, list) or len(value) != 2:
            raise MalformedError(f"field {key!r} must be a [token, logprob] pair")
        return HeaderReader.as_uint(key, value[0]), HeaderReader.as_float(key, value[1])


def check_index_list(name: str, values: Iterable[int], *, unique: bool) -> None:
    """Validate ids built by a sender (the receiver's reader already checked types)."""
    seen: set[int] = set()
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_INT:
            raise MalformedError(f"{name} holds {v!r}, not a non-negative int64")
        if unique and v in seen:
            raise MalformedError(f"{name} repeats {v}")
        seen.add(v)
