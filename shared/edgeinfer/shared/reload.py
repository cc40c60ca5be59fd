"""SIGHUP: re-read a process's settings, apply the ones that can change live, report the rest.

Most settings (ports, the model, pool sizes) are baked into objects built at start-up; changing
them needs a restart. Rather than silently ignore such an edit, a reload names every changed
setting it could not apply, so the operator knows the file and the process now disagree.
The settings in force are tracked, so a later reload compares against what is running.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from edgeinfer.shared.errors import ConfigError
from edgeinfer.shared.logs import configure_logging

if TYPE_CHECKING:
    from typing import Protocol, TypeGuard

    from _typeshed import DataclassInstance

    from edgeinfer.shared.logs import LogFormat

    class Settings(DataclassInstance, Protocol):
        """A process's frozen settings: a dataclass with the two logging settings."""

        @property
        def log_level(self) -> str: ...
        @property
        def log_format(self) -> LogFormat: ...


T = TypeVar("T", bound="Settings")

log = logging.getLogger(__name__)

# Both processes have these two settings; the logging handler can be reconfigured in place.
LOGGING_KEYS = frozenset({"log_level", "log_format"})


def changed_fields(old: DataclassInstance, new: DataclassInstance) -> dict[str, tuple[Any, Any]]:
    """``{"key": (old, new)}`` for each differing field; nested dataclasses as ``outer.inner``."""
    out: dict[str, tuple[Any, Any]] = {}
    for field in dataclasses.fields(old):
        a, b = getattr(old, field.name), getattr(new, field.name)
        if _is_dataclass_instance(a) and _is_dataclass_instance(b):
            inner = changed_fields(a, b)
            out.update({f"{field.name}.{k}": v for k, v in inner.items()})
        elif a != b:
            out[field.name] = (a, b)
    return out


def _is_dataclass_instance(value: object) -> TypeGuard[DataclassInstance]:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


class SettingsReloader(Generic[T]):
    """Holds the settings in force; :meth:`reload` (the SIGHUP handler) updates them."""

    def __init__(self, current: T, load: Callable[[], T], reloadable: frozenset[str]) -> None:
        self.current = current
        self._load = load
        self.reloadable = reloadable

    def reload(self) -> bool:
        """Apply what can be applied; False (settings untouched) when the file is bad."""
        try:
            new = self._load()
        except ConfigError as exc:
            # A typo must not take a serving process down: keep running as before.
            log.error("SIGHUP: keeping the current settings: %s", exc)
            return False
        changes = changed_fields(self.current, new)
        applied = {k: v for k, v in changes.items() if k in self.reloadable}
        kept = {k: v for k, v in changes.items() if k not in self.reloadable}
        if applied:
            self.current = dataclasses.replace(
                self.current, **{k: new_value for k, (_, new_value) in applied.items()}
            )
            if applied.keys() & LOGGING_KEYS:
                configure_logging(self.current.log_level, self.current.log_format)
        for key, (old, new_value) in applied.items():
            log.info("SIGHUP: reloaded %s: %r -> %r", key, old, new_value)
        if kept:
            listed = ", ".join(f"{k} ({old!r} -> {v!r})" for k, (old, v) in kept.items())
            log.warning("SIGHUP: not reloaded, restart to apply: %s", listed)
        if not changes:
            log.info("SIGHUP: settings unchanged")
        # Logged after the level change, so it shows exactly when debug was just switched on.
        # Only the reloadable keys: the full settings hold secrets (admin_token).
        now = {k: getattr(self.current, k) for k in sorted(self.reloadable)}
        log.debug("SIGHUP: in force now: %s", now)
        return True
