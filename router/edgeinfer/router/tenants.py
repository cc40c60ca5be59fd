"""The API keys file: which keys exist, whose tenant each is, and that tenant's limits.

A TOML file of ``[[key]]`` tables, each holding the SHA-256 of one key (never the key itself),
the tenant it belongs to and optional limits. A tenant may hold several keys (rotation), and its
limits are shared by all of them, so every entry of a tenant must state the same limits; models
are per key. ``edgectl keys`` writes the file (:func:`key_entry_toml`), the router reads it at
start-up and on SIGHUP (:func:`load_keys`) and looks each presented key up in a
:class:`KeyTable`.
"""

from __future__ import annotations

import datetime as dt
import difflib
import hashlib
import hmac
import json
import re
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgeinfer.shared.errors import ConfigError

KEY_PREFIX = "ei-"
# Tenant names and key ids travel in headers and rate-limit storage keys: a safe alphabet.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_LIMITS = ("requests_per_minute", "tokens_per_minute", "max_concurrent")
_ENTRY_KEYS = ("id", "tenant", "sha256", "created", *_LIMITS, "models")


@dataclass(frozen=True)
class TenantKey:
    """One ``[[key]]`` entry. A limit of None means no limit; empty ``models`` means all."""

    tenant: str
    sha256: str  # lower-case hex digest of the key
    id: str | None = None
    created: dt.datetime | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    models: tuple[str, ...] = ()

    def limits(self) -> tuple[int | None, int | None, int | None]:
        return self.requests_per_minute, self.tokens_per_minute, self.max_concurrent

    def allows(self, model: str) -> bool:
        return not self.models or model in self.models


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class KeyTable:
    """The keys of one version of the file, looked up by the digest of a presented key."""

    keys: tuple[TenantKey, ...] = ()
    _by_digest: dict[bytes, TenantKey] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_digest", {bytes.fromhex(k.sha256): k for k in self.keys})

    def lookup(self, presented: str) -> TenantKey | None:
        """The entry of ``presented``, or None. The digest of a secret reveals nothing of it,
        so finding the candidate by digest is safe; the final compare is constant-time."""
        digest = hashlib.sha256(presented.encode()).digest()
        entry = self._by_digest.get(digest)
        if entry is None or not hmac.compare_digest(digest, bytes.fromhex(entry.sha256)):
            return None
        return entry

    def tenants(self) -> set[str]:
        return {k.tenant for k in self.keys}


def load_keys(path: Path) -> tuple[TenantKey, ...]:
    """Read and validate the keys file; every problem is a ConfigError naming entry and key."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read api_keys_file {path}: {e.strerror or e}") from e
    return parse_keys(text, str(path))


def parse_keys(text: str, where: str) -> tuple[TenantKey, ...]:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"invalid TOML in {where}: {e}") from e
    unknown = sorted(set(data) - {"key"})
    if unknown:
        raise ConfigError(f"unknown table or key {unknown[0]!r} in {where}; expected [[key]]")
    tables = data.get("key", [])
    if not isinstance(tables, list):
        raise ConfigError(f"{where}: 'key' must be an array of tables ([[key]])")
    keys = tuple(_parse_entry(t, f"{where} [[key]] #{i + 1}") for i, t in enumerate(tables))
    _check_consistent(keys, where)
    return keys


def _parse_entry(table: Any, where: str) -> TenantKey:
    if not isinstance(table, dict):
        raise ConfigError(f"{where} must be a table")
    raw_tenant = table.get("tenant")
    if isinstance(raw_tenant, str) and _NAME.fullmatch(raw_tenant):
        where = f"{where} (tenant {raw_tenant})"
    for name in table:
        if name not in _ENTRY_KEYS:
            close = difflib.get_close_matches(name, _ENTRY_KEYS, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"unknown key '{name}' in {where}{hint}")
    for name in ("tenant", "sha256"):
        if name not in table:
            raise ConfigError(f"{where} is missing '{name}'")
    tenant = _name(table["tenant"], f"{where}: 'tenant'")
    sha256 = table["sha256"]
    if not isinstance(sha256, str) or not _SHA256.fullmatch(sha256.lower()):
        raise ConfigError(f"{where}: 'sha256' must be 64 hex digits (the key's SHA-256)")
    created = table.get("created")
    if created is not None and not isinstance(created, dt.datetime):
        raise ConfigError(f"{where}: 'created' must be a TOML date-time, got {created!r}")
    models = table.get("models", [])
    if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
        raise ConfigError(f"{where}: 'models' must be a list of model names")
    return TenantKey(
        tenant=tenant,
        sha256=sha256.lower(),
        id=_name(table["id"], f"{where}: 'id'") if "id" in table else None,
        created=created,
        requests_per_minute=_limit(table, "requests_per_minute", where),
        tokens_per_minute=_limit(table, "tokens_per_minute", where),
        max_concurrent=_limit(table, "max_concurrent", where),
        models=tuple(dict.fromkeys(models)),
    )


def _name(raw: Any, what: str) -> str:
    if not isinstance(raw, str) or not _NAME.fullmatch(raw):
        raise ConfigError(f"{what} must be 1-64 characters of [A-Za-z0-9._-], got {raw!r}")
    return raw


def _limit(table: dict[str, Any], name: str, where: str) -> int | None:
    raw = table.get(name)
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
        raise ConfigError(f"{where}: '{name}' must be an integer >= 1, got {raw!r}")
    return raw


def _check_consistent(keys: tuple[TenantKey, ...], where: str) -> None:
    digests: set[str] = set()
    ids: set[str] = set()
    limits: dict[str, TenantKey] = {}
    for key in keys:
        if key.sha256 in digests:
            raise ConfigError(
                f"{where}: the same key (sha256 {key.sha256[:12]}...) is listed twice"
            )
        digests.add(key.sha256)
        if key.id is not None:
            if key.id in ids:
                raise ConfigError(f"{where}: key id {key.id!r} is used twice")
            ids.add(key.id)
        first = limits.setdefault(key.tenant, key)
        if first.limits() != key.limits():
            raise ConfigError(
                f"{where}: the keys of tenant {key.tenant!r} state different limits; a tenant's "
                f"keys share its limits, so {', '.join(_LIMITS)} must be equal on each"
            )


def key_entry_toml(key: TenantKey) -> str:
    """One ``[[key]]`` table as TOML text, in the order :func:`parse_keys` documents."""
    lines = ["[[key]]"]
    if key.id is not None:
        lines.append(f"id = {_toml_str(key.id)}")
    lines += [f"tenant = {_toml_str(key.tenant)}", f"sha256 = {_toml_str(key.sha256)}"]
    if key.created is not None:
        lines.append(f"created = {key.created.isoformat()}")
    for name, value in zip(_LIMITS, key.limits(), strict=True):
        if value is not None:
            lines.append(f"{name} = {value}")
    if key.models:
        lines.append(f"models = [{', '.join(_toml_str(m) for m in key.models)}]")
    return "\n".join(lines) + "\n"


def keys_file_toml(keys: Iterable[TenantKey], header: str) -> str:
    """A whole keys file: ``header`` (comment lines) then one table per key."""
    return header + "".join("\n" + key_entry_toml(k) for k in keys)


def _toml_str(value: str) -> str:
    # A JSON string is a TOML basic string (same escapes), once DEL, which JSON leaves raw and
    # TOML forbids, is escaped too; ASCII-only JSON would write surrogate pairs TOML refuses.
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
