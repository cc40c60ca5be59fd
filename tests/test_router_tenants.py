"""The API keys file: validation with errors that name the entry and key, lookup, and writing."""

from __future__ import annotations

import datetime as dt
import hashlib
from pathlib import Path

import pytest

from edgeinfer.router.tenants import (
    KeyTable,
    TenantKey,
    key_digest,
    key_entry_toml,
    keys_file_toml,
    load_keys,
    parse_keys,
)
from edgeinfer.shared.errors import ConfigError

ACME_KEY = "ei-acme-secret"
ACME = f"""
[[key]]
id = "k_1"
tenant = "acme"
sha256 = "{key_digest(ACME_KEY)}"
created = 2025-06-01T12:00:00Z
requests_per_minute = 60
tokens_per_minute = 10000
max_concurrent = 4
models = ["tiny", "small"]
"""


def entry(**fields: object) -> str:
    body = {"tenant": '"acme"', "sha256": f'"{"a" * 64}"', **fields}
    return "[[key]]\n" + "".join(f"{k} = {v}\n" for k, v in body.items())


def test_a_full_entry_parses() -> None:
    (key,) = parse_keys(ACME, "keys.toml")
    assert key == TenantKey(
        tenant="acme",
        sha256=hashlib.sha256(ACME_KEY.encode()).hexdigest(),
        id="k_1",
        created=dt.datetime(2025, 6, 1, 12, tzinfo=dt.UTC),
        requests_per_minute=60,
        tokens_per_minute=10000,
        max_concurrent=4,
        models=("tiny", "small"),
    )
    assert key.allows("tiny") and not key.allows("big")


def test_a_minimal_entry_has_no_limits_and_allows_every_model() -> None:
    (key,) = parse_keys(entry(sha256=f'"{"AB" * 32}"'), "keys.toml")
    assert key.sha256 == "ab" * 32  # stored lower-case, compared as bytes
    assert key.limits() == (None, None, None)
    assert key.allows("anything")


def test_an_empty_file_holds_no_keys() -> None:
    assert parse_keys("# nobody yet\n", "keys.toml") == ()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (entry(requests_per_min="5"),
         "unknown key 'requests_per_min' in keys.toml [[key]] #1 (tenant acme); did you mean 'requests_per_minute'?"),
        (entry(plain_key='"ei-x"'), "unknown key 'plain_key' in keys.toml [[key]] #1 (tenant acme)"),
        ("[[keys]]\ntenant = 'a'\n", "unknown table or key 'keys' in keys.toml; expected [[key]]"),
        ("key = 3\n", "keys.toml: 'key' must be an array of tables ([[key]])"),
        ('[[key]]\ntenant = "acme"\n', "keys.toml [[key]] #1 (tenant acme) is missing 'sha256'"),
        (entry(tenant='"a b"'),
         "keys.toml [[key]] #1: 'tenant' must be 1-64 characters of [A-Za-z0-9._-], got 'a b'"),
        (entry(sha256='"abc"'),
         "keys.toml [[key]] #1 (tenant acme): 'sha256' must be 64 hex digits (the key's SHA-256)"),
        (entry(requests_per_minute="0"),
         "keys.toml [[key]] #1 (tenant acme): 'requests_per_minute' must be an integer >= 1, got 0"),
        (entry(max_concurrent="true"),
         "keys.toml [[key]] #1 (tenant acme): 'max_concurrent' must be an integer >= 1, got True"),
        (entry(models='"tiny"'),
         "keys.toml [[key]] #1 (tenant acme): 'models' must be a list of model names"),
        (entry(created='"yesterday"'),
         "keys.toml [[key]] #1 (tenant acme): 'created' must be a TOML date-time, got 'yesterday'"),
        ("[[key]\n", "invalid TOML in keys.toml"),
    ],
    ids=["typo", "unknown", "table", "not-array", "missing", "tenant", "sha", "zero", "bool",
         "models", "created", "toml"],
)  # fmt: skip
def test_bad_entries_are_refused_naming_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_keys(text, "keys.toml")
    assert str(err.value).startswith(message)


def test_one_key_listed_twice_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"the same key \(sha256 aaaaaaaaaaaa\.\.\.\) is listed"):
        parse_keys(entry() + entry(tenant='"other"'), "keys.toml")


def test_one_id_used_twice_is_refused() -> None:
    with pytest.raises(ConfigError, match="key id 'k' is used twice"):
        parse_keys(entry(id='"k"') + entry(id='"k"', sha256=f'"{"b" * 64}"'), "keys.toml")


def test_a_tenants_keys_share_its_limits() -> None:
    second = entry(sha256=f'"{"b" * 64}"', requests_per_minute=10, models='["tiny"]')
    with pytest.raises(ConfigError, match="the keys of tenant 'acme' state different limits"):
        parse_keys(entry(requests_per_minute=5) + second, "keys.toml")
    # Same limits, different models: fine (models are per key).
    keys = parse_keys(entry(requests_per_minute=10) + second, "keys.toml")
    assert [k.models for k in keys] == [(), ("tiny",)]


def test_lookup_finds_the_key_by_its_digest_only() -> None:
    table = KeyTable(parse_keys(ACME, "keys.toml"))
    found = table.lookup(ACME_KEY)
    assert found is not None and found.tenant == "acme"
    assert table.lookup(ACME_KEY + "x") is None
    assert table.lookup(key_digest(ACME_KEY)) is None  # the stored digest is not a key
    assert table.lookup("") is None
    assert KeyTable().lookup(ACME_KEY) is None


def test_load_keys_names_an_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"cannot read api_keys_file {tmp_path}/nope.toml"):
        load_keys(tmp_path / "nope.toml")


def test_written_entries_read_back_identical(tmp_path: Path) -> None:
    odd = ("tiny", 'quote " and \\ backslash', "tab\tnew\nline", "del\x7f", "ünï", "emoji 🦙")
    keys = (
        TenantKey(tenant="acme", sha256="c" * 64, id="k_9", models=odd,
                  created=dt.datetime(2025, 1, 2, 3, 4, 5, tzinfo=dt.UTC),
                  requests_per_minute=1, tokens_per_minute=2, max_concurrent=3),
        TenantKey(tenant="beta", sha256="d" * 64),
    )  # fmt: skip
    path = tmp_path / "keys.toml"
    path.write_text(keys_file_toml(keys, "# header\n"))
    assert load_keys(path) == keys


def test_an_entry_is_written_in_the_documented_order() -> None:
    key = TenantKey(
        tenant="acme", sha256="e" * 64, id="k_2", max_concurrent=2, models=("tiny",),
        created=dt.datetime(2025, 1, 2, 3, 4, 5, tzinfo=dt.UTC),
    )  # fmt: skip
    assert key_entry_toml(key) == (
        "[[key]]\n"
        'id = "k_2"\n'
        'tenant = "acme"\n'
        f'sha256 = "{"e" * 64}"\n'
        "created = 2025-01-02T03:04:05+00:00\n"
        "max_concurrent = 2\n"
        'models = ["tiny"]\n'
    )
