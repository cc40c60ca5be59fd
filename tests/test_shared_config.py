"""Layered config loader: defaults < TOML < env < flags, with errors that name key and source."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Literal

import pytest

from edgeinfer.shared.config import load_config
from edgeinfer.shared.errors import ConfigError, EdgeInferError


@dataclasses.dataclass(frozen=True)
class KV:
    block_size: int = 16
    dtype: Literal["float16", "bfloat16"] = "bfloat16"


@dataclasses.dataclass(frozen=True)
class Cfg:
    role: Literal["both", "prefill", "decode"] = "both"
    port: int = 8000
    temperature: float = 1.0
    verbose: bool = False
    model_dir: Path = Path("/models")
    prefill_peer: str | None = None
    peers: tuple[str, ...] = ()
    kv: KV = dataclasses.field(default_factory=lambda: KV(block_size=32))


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "edge.toml"
    path.write_text(text)
    return path


def test_defaults_only() -> None:
    cfg = load_config(Cfg, env={})
    assert cfg == Cfg()
    # The outer default_factory's inner value wins over KV's own default.
    assert cfg.kv.block_size == 32


def test_layers_in_order(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '[daemon]\nrole = "prefill"\nport = 9000\nprefill-peer = "tcp://a:1"\n'
        'peers = ["x", "y"]\n[daemon.kv]\nblock-size = 64\n[router]\nport = 1\n',
    )
    env = {"EDGEINFER_PORT": "9100", "EDGEINFER_KV_DTYPE": "float16", "EDGEINFER_OTHER": "x"}
    cfg = load_config(
        Cfg, toml_path=path, section="daemon", env=env, overrides={"port": 9200, "verbose": None}
    )
    assert cfg.role == "prefill"
    assert cfg.port == 9200  # flag beats env beats file
    assert cfg.prefill_peer == "tcp://a:1"
    assert cfg.peers == ("x", "y")
    assert cfg.kv == KV(block_size=64, dtype="float16")
    assert cfg.verbose is False  # None override means "flag not given"


@pytest.mark.parametrize(
    ("var", "value", "field", "expected"),
    [
        ("EDGEINFER_VERBOSE", "true", "verbose", True),
        ("EDGEINFER_VERBOSE", "0", "verbose", False),
        ("EDGEINFER_VERBOSE", "On", "verbose", True),
        ("EDGEINFER_PEERS", "a, b,,c", "peers", ("a", "b", "c")),
        ("EDGEINFER_PEERS", "", "peers", ()),
        ("EDGEINFER_PREFILL_PEER", "", "prefill_peer", None),
        ("EDGEINFER_TEMPERATURE", "0.5", "temperature", 0.5),
        ("EDGEINFER_TEMPERATURE", "2", "temperature", 2.0),
        ("EDGEINFER_MODEL_DIR", "~/m", "model_dir", Path("~/m").expanduser()),
        ("EDGEINFER_KV_BLOCK_SIZE", " 8 ", "kv", KV(block_size=8)),
    ],
)
def test_env_parsing(var: str, value: str, field: str, expected: object) -> None:
    cfg = load_config(Cfg, env={var: value})
    assert getattr(cfg, field) == expected


def test_bad_literal_names_key_and_env_var() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(Cfg, env={"EDGEINFER_ROLE": "foo"})
    assert str(info.value) == (
        "config key 'role': expected one of both|prefill|decode, got 'foo' (from EDGEINFER_ROLE)"
    )
    assert isinstance(info.value, EdgeInferError)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"port": "80x"}, "config key 'port': expected an integer, got '80x' (from flag --port)"),
        ({"port": True}, "expected an integer, got True"),
        ({"verbose": "maybe"}, "config key 'verbose': expected a boolean"),
        ({"temperature": "nan"}, "expected a finite number"),
        ({"model_dir": ""}, "expected a non-empty path"),
        ({"peers": [1]}, "config key 'peers[0]': expected a string"),
        ({"kv.dtype": "int8"}, "config key 'kv.dtype': expected one of float16|bfloat16"),
        ({"nope": 1}, "unknown config key 'nope' (from flag --nope)"),
    ],
)
def test_bad_override(overrides: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        load_config(Cfg, env={}, overrides=overrides)


def test_bad_toml_value_names_file_and_section(tmp_path: Path) -> None:
    path = write(tmp_path, '[daemon]\nport = "eighty"\n')
    with pytest.raises(ConfigError) as info:
        load_config(Cfg, toml_path=path, section="daemon", env={})
    assert f"(from {path} [daemon])" in str(info.value)


def test_unknown_toml_key_suggests_close_match(tmp_path: Path) -> None:
    path = write(tmp_path, '[daemon]\nprefil_peer = "x"\n')
    with pytest.raises(ConfigError) as info:
        load_config(Cfg, toml_path=path, section="daemon", env={})
    assert str(info.value) == (
        f"unknown config key 'prefil_peer' in {path} [daemon]; did you mean 'prefill_peer'?"
    )


def test_unknown_nested_key_names_subtable(tmp_path: Path) -> None:
    path = write(tmp_path, "[daemon.kv]\nblok_size = 1\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'blok_size' in .* \[daemon\.kv\]"):
        load_config(Cfg, toml_path=path, section="daemon", env={})


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("port = 1\nport-x = 2\n[daemon\n", "invalid TOML"),
        ("daemon = 3\n", "must be a table"),
        ("[daemon]\nkv = 3\n", "config key 'kv' in .* must be a table"),
        ("[daemon]\nprefill-peer = 'a'\nprefill_peer = 'b'\n", "given twice"),
    ],
)
def test_malformed_files(tmp_path: Path, text: str, fragment: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=fragment):
        load_config(Cfg, toml_path=path, section="daemon", env={})


def test_missing_file_and_missing_section(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(Cfg, toml_path=tmp_path / "absent.toml", env={})
    # A file configuring only the router is fine for the daemon.
    path = write(tmp_path, "[router]\nport = 1\n")
    assert load_config(Cfg, toml_path=path, section="daemon", env={}) == Cfg()


def test_whole_file_without_section(tmp_path: Path) -> None:
    path = write(tmp_path, 'role = "decode"\n')
    assert load_config(Cfg, toml_path=path, env={}).role == "decode"


def test_required_field_and_bad_class() -> None:
    @dataclasses.dataclass(frozen=True)
    class Needs:
        name: str

    with pytest.raises(ConfigError, match="missing required config key 'name'"):
        load_config(Needs, env={})
    assert load_config(Needs, env={"EDGEINFER_NAME": "x"}).name == "x"
    with pytest.raises(TypeError):
        load_config(int, env={})  # type: ignore[type-var]


def test_unsupported_field_type_is_a_programming_error() -> None:
    @dataclasses.dataclass(frozen=True)
    class Odd:
        both: int | str = 0

    with pytest.raises(TypeError, match=re.escape("only `X | None` unions")):
        load_config(Odd, env={"EDGEINFER_BOTH": "1"})
