"""``edgectl keys create/list/revoke``: the API keys file a router reads (``api_keys_file``).

``create`` prints a new key once, on stdout alone (``KEY=$(edgectl keys create ...)`` works),
and stores only its SHA-256, appended to the file (comments are kept). ``revoke`` rewrites the
file from the entries left, under the standard header. Every change is written to a temporary file in the same directory
and renamed over the old one, so a router reading the file (SIGHUP) sees the old or the new
version, never half of one; a new file is created readable by its owner only. Send the router
SIGHUP afterwards (``systemctl reload edge-router``) for the change to take effect.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import secrets
import tempfile
from pathlib import Path

import click
from rich import box
from rich.console import Console
from rich.table import Table

from edgeinfer.router.tenants import (
    KEY_PREFIX,
    TenantKey,
    key_digest,
    key_entry_toml,
    keys_file_toml,
    load_keys,
    parse_keys,
)
from edgeinfer.shared.errors import ConfigError

HEADER = (
    "# edgeinfer API keys (the router's api_keys_file): one [[key]] table per key, holding the\n"
    "# SHA-256 of the key, never the key. Written by `edgectl keys`; the router re-reads it on\n"
    "# SIGHUP. A tenant's keys share its limits (requests_per_minute, tokens_per_minute,\n"
    "# max_concurrent); models (empty or absent: all) is per key.\n"
)
COLUMNS = ("tenant", "id", "requests/min", "tokens/min", "max concurrent", "models", "created")
KEY_BYTES = 32  # of entropy: what secrets.token_urlsafe(32) encodes in 43 characters
_NONE = "-"

_file_option = click.option(
    "--file",
    "path",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="EDGEINFER_API_KEYS_FILE",
    help="The keys file (the router's api_keys_file).  [env: EDGEINFER_API_KEYS_FILE]",
)


@click.group()
def keys() -> None:
    """Create, list and revoke the API keys of the router's public endpoint."""


@keys.command()
@click.option("--tenant", required=True, help="Who the key belongs to (1-64 of [A-Za-z0-9._-]).")
@_file_option
@click.option("--rpm", type=click.IntRange(min=1), help="Requests per minute of the tenant.")
@click.option("--tpm", type=click.IntRange(min=1), help="Tokens (prompt + completion) per minute.")
@click.option("--max-concurrent", type=click.IntRange(min=1), help="Requests in flight at once.")
@click.option("--model", "models", multiple=True, help="A model the key may use (repeatable; default all).")  # fmt: skip
def create(
    tenant: str,
    path: Path,
    rpm: int | None,
    tpm: int | None,
    max_concurrent: int | None,
    models: tuple[str, ...],
) -> None:
    """Make a new key for TENANT, print it once, and add its hash to the file."""
    existing = load_keys(path) if path.exists() else ()
    text = path.read_text() if path.exists() else HEADER
    limits = _tenant_limits(existing, tenant, (rpm, tpm, max_concurrent), path)
    key = KEY_PREFIX + secrets.token_urlsafe(KEY_BYTES)
    ids = {k.id for k in existing}
    key_id = _new_id()
    while key_id in ids:
        key_id = _new_id()
    entry = TenantKey(
        tenant=tenant,
        sha256=key_digest(key),
        id=key_id,
        created=dt.datetime.now(dt.UTC).replace(microsecond=0),
        requests_per_minute=limits[0],
        tokens_per_minute=limits[1],
        max_concurrent=limits[2],
        models=tuple(dict.fromkeys(models)),
    )
    new_text = text + ("" if text.endswith("\n") else "\n") + "\n" + key_entry_toml(entry)
    parse_keys(new_text, str(path))  # the file must stay one the router accepts
    _write(path, new_text)
    click.echo(key)
    click.echo(
        f"created key {entry.id} of tenant {tenant} in {path}; it is shown only this once. "
        "Reload the router (SIGHUP) to use it.",
        err=True,
    )


@keys.command(name="list")
@_file_option
def list_keys(path: Path) -> None:
    """Show every key's tenant, id and limits (never the keys)."""
    console = Console()
    if not console.is_terminal:
        console.width = 1000  # piped: never wrap or truncate rows to a guessed 80 columns
    console.print(keys_table(load_keys(path)))


@keys.command()
@_file_option
@click.option("--tenant", help="Revoke every key of this tenant.")
@click.option("--id", "key_id", help="Revoke the key with this id.")
def revoke(path: Path, tenant: str | None, key_id: str | None) -> None:
    """Remove keys from the file (by --tenant or --id); SIGHUP the router to refuse them."""
    if (tenant is None) == (key_id is None):
        raise click.UsageError("give exactly one of --tenant and --id")
    existing = load_keys(path)
    gone = [k for k in existing if k.tenant == tenant or (key_id is not None and k.id == key_id)]
    if not gone:
        what = f"tenant {tenant!r}" if tenant is not None else f"id {key_id!r}"
        raise ConfigError(f"no key of {what} in {path}")
    _write(path, keys_file_toml((k for k in existing if k not in gone), HEADER))
    for k in gone:
        click.echo(f"revoked key {k.id or _NONE} of tenant {k.tenant}")
    click.echo(
        "Reload the router (SIGHUP) to refuse them; their streams in flight finish.", err=True
    )


def _new_id() -> str:
    return "k_" + secrets.token_hex(6)


def _tenant_limits(
    existing: tuple[TenantKey, ...],
    tenant: str,
    given: tuple[int | None, int | None, int | None],
    path: Path,
) -> tuple[int | None, int | None, int | None]:
    """A new key's limits: a known tenant's keys share its limits, so unstated ones are its."""
    current = next((k.limits() for k in existing if k.tenant == tenant), None)
    if current is None:
        return given
    for flag, new, old in zip(("--rpm", "--tpm", "--max-concurrent"), given, current, strict=True):
        if new is not None and new != old:
            raise ConfigError(
                f"tenant {tenant!r} has {flag} {old if old is not None else 'unlimited'} on its "
                f"other keys, which share its limits: leave {flag} out, or edit {path} to change "
                "it on every key of the tenant"
            )
    return current


def keys_table(entries: tuple[TenantKey, ...]) -> Table:
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for header in COLUMNS:
        numeric = header in ("requests/min", "tokens/min", "max concurrent")
        table.add_column(header, justify="right" if numeric else "left")
    # By tenant, then oldest first (as text: a hand-written local time has no offset to compare).
    for k in sorted(entries, key=lambda k: (k.tenant, k.created.isoformat() if k.created else "")):
        table.add_row(
            k.tenant,
            k.id or _NONE,
            *(_NONE if v is None else str(v) for v in k.limits()),
            ", ".join(k.models) or "all",
            k.created.isoformat() if k.created else _NONE,
        )
    return table


def _write(path: Path, text: str) -> None:
    """Replace ``path`` by ``text`` atomically, keeping an existing file's mode and owner."""
    try:
        st: os.stat_result | None = path.stat()
    except FileNotFoundError:
        st = None
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, st.st_mode & 0o777 if st else 0o600)
        if st is not None and hasattr(os, "chown"):
            # Run as root on the router's file: the router (its owner) must still read it.
            with contextlib.suppress(PermissionError):
                os.chown(tmp, st.st_uid, st.st_gid)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
