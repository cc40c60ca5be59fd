"""``edgectl keys create/list/revoke`` through click's CliRunner, on a real keys file."""

from __future__ import annotations

import datetime as dt
import re
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from edgeinfer.ctl.keys import HEADER
from edgeinfer.ctl.main import cli
from edgeinfer.router.tenants import KeyTable, TenantKey, key_digest, keys_file_toml, load_keys

KEY = re.compile(r"ei-[A-Za-z0-9_-]{43}")  # 32 random bytes, base64url
T0 = dt.datetime(2025, 6, 1, 12, tzinfo=dt.UTC)
ENTRIES = [
    TenantKey("beta", "b" * 64, id="k_b", created=T0, max_concurrent=2, models=("tiny", "small")),
    TenantKey("acme", "a" * 64, id="k_a2", created=T0.replace(hour=13),
              requests_per_minute=600, tokens_per_minute=200000),
    TenantKey("acme", "c" * 64, id="k_a1", created=T0,
              requests_per_minute=600, tokens_per_minute=200000),
    TenantKey("ops", "d" * 64),
]  # fmt: skip
TABLE = """\
tenant   id     requests/min   tokens/min   max concurrent   models        created                  
────────────────────────────────────────────────────────────────────────────────────────────────────
acme     k_a1            600       200000                -   all           2025-06-01T12:00:00+00:00
acme     k_a2            600       200000                -   all           2025-06-01T13:00:00+00:00
beta     k_b               -            -                2   tiny, small   2025-06-01T12:00:00+00:00
ops      -                 -            -                -   all           -                        
"""  # noqa: W291 - rich pads every cell of the last column


def edgectl(*args: str) -> Result:
    return CliRunner().invoke(cli, ["keys", *args])


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys.toml"
    path.write_text(keys_file_toml(ENTRIES, HEADER))
    return path


def test_create_prints_the_key_once_and_stores_only_its_hash(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    result = edgectl("create", "--tenant", "acme", "--file", str(path), "--rpm", "60",
                     "--tpm", "1000", "--max-concurrent", "4", "--model", "tiny")  # fmt: skip
    assert result.exit_code == 0, result.output
    key = result.stdout.strip()
    assert KEY.fullmatch(key), result.stdout  # stdout is the key alone: KEY=$(edgectl ...)
    (entry,) = load_keys(path)
    assert result.stderr == (
        f"created key {entry.id} of tenant acme in {path}; it is shown only this once. "
        "Reload the router (SIGHUP) to use it.\n"
    )
    assert key not in path.read_text()
    assert entry.sha256 == key_digest(key)
    assert KeyTable((entry,)).lookup(key) == entry
    assert (entry.tenant, entry.limits(), entry.models) == ("acme", (60, 1000, 4), ("tiny",))
    assert entry.id is not None and re.fullmatch(r"k_[0-9a-f]{12}", entry.id)
    assert entry.created is not None and entry.created.tzinfo is not None
    assert path.read_text().startswith(HEADER)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_tenants_next_key_shares_its_limits(keys_file: Path) -> None:
    before = keys_file.read_text()
    result = edgectl("create", "--tenant", "acme", "--file", str(keys_file))
    assert result.exit_code == 0, result.output
    keys = load_keys(keys_file)
    assert keys[:4] == tuple(ENTRIES)
    assert keys[4].limits() == (600, 200000, None)
    assert keys_file.read_text().startswith(before)  # appended: comments and order are kept
    key = result.stdout.strip()
    other = edgectl("create", "--tenant", "acme", "--file", str(keys_file)).stdout.strip()
    assert key != other


def test_a_key_cannot_change_its_tenants_limits(keys_file: Path) -> None:
    before = keys_file.read_text()
    result = edgectl("create", "--tenant", "acme", "--file", str(keys_file), "--rpm", "5")
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr == (
        "error: tenant 'acme' has --rpm 600 on its other keys, which share its limits: leave "
        f"--rpm out, or edit {keys_file} to change it on every key of the tenant\n"
    )
    assert keys_file.read_text() == before


def test_a_bad_tenant_name_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    result = edgectl("create", "--tenant", "a b", "--file", str(path))
    assert result.exit_code == 1
    assert result.stdout == ""  # no key printed for nothing
    assert result.stderr.startswith(
        f"error: {path} [[key]] #1: 'tenant' must be 1-64 characters of [A-Za-z0-9._-], got 'a b'"
    )
    assert not path.exists()


def test_an_existing_files_mode_is_kept(keys_file: Path) -> None:
    keys_file.chmod(0o640)  # e.g. readable by the router's group
    assert edgectl("create", "--tenant", "new", "--file", str(keys_file)).exit_code == 0
    assert stat.S_IMODE(keys_file.stat().st_mode) == 0o640
    assert not [p for p in keys_file.parent.iterdir() if p.name != "keys.toml"]  # no temp left


def test_list_shows_tenants_and_limits_never_keys(keys_file: Path) -> None:
    result = edgectl("list", "--file", str(keys_file))
    assert result.exit_code == 0, result.output
    assert result.stdout == TABLE
    assert "a" * 64 not in result.stdout


def test_list_of_a_broken_file_is_one_error_line(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text('[[key]]\ntenant = "acme"\nsha256 = "' + "a" * 64 + '"\nrpm = 5\n')
    result = edgectl("list", "--file", str(path))
    assert result.exit_code == 1
    assert result.stderr == f"error: unknown key 'rpm' in {path} [[key]] #1 (tenant acme)\n"


def test_revoke_by_tenant_and_by_id(keys_file: Path) -> None:
    result = edgectl("revoke", "--file", str(keys_file), "--tenant", "acme")
    assert (result.exit_code, result.stdout) == (
        0, "revoked key k_a2 of tenant acme\nrevoked key k_a1 of tenant acme\n"
    )  # fmt: skip
    assert [k.tenant for k in load_keys(keys_file)] == ["beta", "ops"]
    result = edgectl("revoke", "--file", str(keys_file), "--id", "k_b")
    assert (result.exit_code, result.stdout) == (0, "revoked key k_b of tenant beta\n")
    assert load_keys(keys_file) == (ENTRIES[3],)
    assert keys_file.read_text().startswith(HEADER)


def test_revoke_of_nothing_is_an_error(keys_file: Path) -> None:
    before = keys_file.read_text()
    result = edgectl("revoke", "--file", str(keys_file), "--id", "k_zzz")
    assert (result.exit_code, result.stderr) == (1, f"error: no key of id 'k_zzz' in {keys_file}\n")
    assert keys_file.read_text() == before


@pytest.mark.parametrize("args", [[], ["--tenant", "acme", "--id", "k_b"]])
def test_revoke_needs_exactly_one_selector(keys_file: Path, args: list[str]) -> None:
    result = edgectl("revoke", "--file", str(keys_file), *args)
    assert result.exit_code == 2
    assert "give exactly one of --tenant and --id" in result.stderr
