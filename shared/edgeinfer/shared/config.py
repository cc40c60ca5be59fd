"""Layered configuration: dataclass defaults < TOML file < ``EDGEINFER_*`` env vars < CLI flags.

Each process describes its settings as one frozen dataclass (``DaemonConfig``, ``RouterConfig``);
the dataclass is the only place defaults live. :func:`load_config` fills it in from:

1. a TOML file (``tomllib``), optionally one ``[section]`` of it so the router and the daemon can
   share a file. Keys are the field names, ``-`` and ``_`` interchangeable. A nested frozen
   dataclass field is a sub-table (``[daemon.kv]``). A key that matches no field is an error
   naming it and the closest field, because a typo silently ignored is a setting silently lost.
   A missing ``[section]`` counts as empty: a file may legitimately configure only one process.
2. environment variables ``EDGEINFER_<FIELD>`` (nested: ``EDGEINFER_<OUTER>_<INNER>``). A variable
   with the prefix that matches no field is *ignored*, not an error: the router and the daemon
   share the prefix, so each sees the other's variables.
3. ``overrides``, normally the parsed CLI flags, keyed by field name (``outer.inner`` for nested
   fields). A ``None`` value means "flag not given", which is how click reports an absent option.

Supported field types: ``str``, ``int``, ``float``, ``bool``, ``Path``, ``X | None``,
``tuple[X, ...]``, ``Literal[...]`` and nested frozen dataclasses. Strings (always, for env vars)
are parsed: booleans from ``true/false/1/0/yes/no/on/off``, tuples from comma-separated items, and
an empty string means ``None`` for an optional field (TOML has no null). Every error is a
:class:`ConfigError` naming the key and where the value came from.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import tomllib
import types
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from edgeinfer.shared.errors import ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

ENV_PREFIX = "EDGEINFER_"

T = TypeVar("T", bound="DataclassInstance")

_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})


@dataclasses.dataclass(frozen=True)
class _Given:
    """A raw value plus where it came from, kept together so every error can name its source."""

    raw: Any
    source: str


def load_config(
    cls: type[T],
    *,
    toml_path: Path | None = None,
    section: str | None = None,
    env: Mapping[str, str],
    overrides: Mapping[str, Any] | None = None,
) -> T:
    """Build ``cls`` from its defaults, then ``toml_path``, then ``env``, then ``overrides``.

    ``env`` is required (pass ``os.environ``) so that tests never pick up the caller's shell.
    Raises :class:`ConfigError` for bad input and ``TypeError`` if ``cls`` itself is unusable.
    """
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"load_config needs a dataclass type, got {cls!r}")
    leaves = _leaf_types(cls, ())
    given: dict[tuple[str, ...], _Given] = {}
    if toml_path is not None:
        _read_toml(cls, toml_path, section, given)
    _read_env(leaves, env, given)
    _read_overrides(leaves, overrides or {}, given)
    return _build(cls, (), leaves, given, default=None)


def _leaf_types(cls: type, prefix: tuple[str, ...]) -> dict[tuple[str, ...], Any]:
    """Map the path of every non-dataclass field (``("kv", "block_size")``) to its type hint."""
    out: dict[tuple[str, ...], Any] = {}
    hints = get_type_hints(cls)
    for field in dataclasses.fields(cls):
        tp = hints[field.name]
        path = (*prefix, field.name)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            out.update(_leaf_types(tp, path))
        else:
            out[path] = tp
    return out


def _read_toml(
    cls: type, path: Path, section: str | None, given: dict[tuple[str, ...], _Given]
) -> None:
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"invalid TOML in {path}: {e}") from e
    table: Any = data if section is None else data.get(section, {})
    where = f"{path} [{section}]" if section else str(path)
    if not isinstance(table, dict):
        raise ConfigError(f"config section [{section}] in {path} must be a table")
    _read_table(cls, table, (), path, section, where, given)


def _read_table(
    cls: type,
    table: dict[str, Any],
    prefix: tuple[str, ...],
    path: Path,
    section: str | None,
    where: str,
    given: dict[tuple[str, ...], _Given],
) -> None:
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    seen: dict[str, str] = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"unknown config key '{key}' in {where}{hint}")
        if name in seen:
            raise ConfigError(
                f"config key '{name}' given twice in {where} ('{seen[name]}', '{key}')"
            )
        seen[name] = key
        tp = hints[name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"config key '{key}' in {where} must be a table")
            sub = ".".join(p for p in (section, *prefix, name) if p)
            _read_table(tp, value, (*prefix, name), path, section, f"{path} [{sub}]", given)
        else:
            given[(*prefix, name)] = _Given(value, where)


def _read_env(
    leaves: Mapping[tuple[str, ...], Any],
    env: Mapping[str, str],
    given: dict[tuple[str, ...], _Given],
) -> None:
    by_var: dict[str, tuple[str, ...]] = {}
    for path in leaves:
        var = ENV_PREFIX + "_".join(path).upper()
        if var in by_var:
            # e.g. a field `kv_size` next to a nested `kv.size`: refuse rather than guess.
            raise TypeError(f"fields {by_var[var]} and {path} map to the same env var {var}")
        by_var[var] = path
    for var, path in by_var.items():
        if var in env:
            given[path] = _Given(env[var], var)


def _read_overrides(
    leaves: Mapping[tuple[str, ...], Any],
    overrides: Mapping[str, Any],
    given: dict[tuple[str, ...], _Given],
) -> None:
    for key, value in overrides.items():
        if value is None:
            continue
        flag = "--" + key.replace("_", "-")
        path = tuple(key.replace("-", "_").split("."))
        if path not in leaves:
            raise ConfigError(f"unknown config key '{key}' (from flag {flag})")
        given[path] = _Given(value, f"flag {flag}")


def _build(
    cls: type[T],
    prefix: tuple[str, ...],
    leaves: Mapping[tuple[str, ...], Any],
    given: Mapping[tuple[str, ...], _Given],
    default: T | None,
) -> T:
    hints = get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        path = (*prefix, field.name)
        tp = hints[field.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            # Start from the outer class's default for this field, if it has one, so that a
            # default_factory with non-default inner values is honoured, not rebuilt from scratch.
            inner_default = _field_default(field)
            kwargs[field.name] = _build(tp, path, leaves, given, inner_default)
        elif path in given:
            kwargs[field.name] = _coerce(tp, given[path].raw, ".".join(path), given[path].source)
        elif default is None and not _has_default(field):
            raise ConfigError(f"missing required config key '{'.'.join(path)}'")
    if default is not None:
        return dataclasses.replace(default, **kwargs)
    return cls(**kwargs)


def _has_default(field: dataclasses.Field[Any]) -> bool:
    return (
        field.default is not dataclasses.MISSING or field.default_factory is not dataclasses.MISSING
    )


def _field_default(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def _coerce(tp: Any, raw: Any, key: str, source: str) -> Any:
    """Convert ``raw`` to ``tp`` or raise a ConfigError naming ``key`` and ``source``."""

    def bad(expected: str) -> ConfigError:
        shown = repr(raw)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        return ConfigError(f"config key '{key}': expected {expected}, got {shown} (from {source})")

    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        inner = [a for a in get_args(tp) if a is not type(None)]
        if len(inner) != 1 or len(get_args(tp)) != 2:
            raise TypeError(f"config key '{key}': only `X | None` unions are supported, not {tp}")
        if raw is None or raw == "":
            return None
        return _coerce(inner[0], raw, key, source)
    if origin is Literal:
        choices = get_args(tp)
        for choice in choices:
            # type() check first: True == 1 would otherwise let a bool pass for an int choice.
            if (type(raw) is type(choice) and raw == choice) or (
                isinstance(raw, str) and raw == str(choice)
            ):
                return choice
        raise bad("one of " + "|".join(str(c) for c in choices))
    if origin is tuple:
        args = get_args(tp)
        if len(args) != 2 or args[1] is not Ellipsis:
            raise TypeError(f"config key '{key}': only `tuple[X, ...]` is supported, not {tp}")
        if isinstance(raw, str):
            raw = [item.strip() for item in raw.split(",") if item.strip()]
        if not isinstance(raw, list | tuple):
            raise bad("a list or a comma-separated string")
        return tuple(_coerce(args[0], item, f"{key}[{i}]", source) for i, item in enumerate(raw))
    if tp is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.strip().lower() in _TRUE | _FALSE:
            return raw.strip().lower() in _TRUE
        raise bad("a boolean (true/false/1/0)")
    if tp is int:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        if isinstance(raw, str):
            try:
                return int(raw.strip())
            except ValueError:
                pass
        raise bad("an integer")
    if tp is float:
        if isinstance(raw, int | float | str) and not isinstance(raw, bool):
            try:
                value = float(raw)
            except (ValueError, OverflowError):
                value = math.nan
            if math.isfinite(value):
                return value
        raise bad("a finite number")
    if tp is str:
        if isinstance(raw, str):
            return raw
        raise bad("a string")
    if tp is Path:
        if isinstance(raw, str | os.PathLike) and str(raw):
            return Path(raw).expanduser()
        raise bad("a non-empty path")
    raise TypeError(f"config key '{key}': unsupported field type {tp!r}")
