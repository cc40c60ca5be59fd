"""deploy/: the unit files pass ``systemd-analyze verify``; the example network's files load; every
config key is documented in docs/DEPLOY.md."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from edgeinfer.daemon.config import DaemonConfig, load_daemon_config
from edgeinfer.router.config import _POP_KEYS, RouterConfig, load_pops, load_router_config

ROOT = Path(__file__).resolve().parent.parent
UNITS = ROOT / "deploy" / "systemd"
EXAMPLES = ROOT / "deploy" / "examples"
INSTALL_BIN = "/opt/edgeinfer/bin/"


def read_env_file(path: Path) -> dict[str, str]:
    """systemd's EnvironmentFile= syntax, as far as the examples use it."""
    pairs = (ln.split("=", 1) for ln in path.read_text().splitlines() if "=" in ln)
    return {k.strip(): v.strip() for k, v in pairs if not k.lstrip().startswith("#")}


def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (Debian package: systemd)")
    # verify insists that ExecStart exists: point the install prefix at stubs, change nothing else.
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name in ("edge-daemon", "edge-router"):
        (stubs / name).write_text("#!/bin/sh\n")
        (stubs / name).chmod(0o755)
    for unit in UNITS.glob("*.service"):
        text = unit.read_text()
        assert INSTALL_BIN in text, unit.name
        (tmp_path / unit.name).write_text(text.replace(INSTALL_BIN, f"{stubs}/"))
    instances = [f"edge-daemon@{role}.service" for role in ("prefill", "decode", "both")]
    units = [str(tmp_path / u) for u in ["edge-router.service", *instances]]
    done = subprocess.run(
        ["systemd-analyze", "verify", *units], capture_output=True, text=True, timeout=60
    )
    # verify exits 0 on unknown keys too, only warning about them: any output is a failure.
    assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), done.stderr


@pytest.mark.parametrize("unit", ["edge-daemon@.service", "edge-router.service"])
def test_units_are_hardened_notify_services(unit: str) -> None:
    text = (UNITS / unit).read_text()
    settings = dict(re.findall(r"^(\w+)=(.*)$", text, re.MULTILINE))
    assert settings["Type"] == "notify" and settings["Restart"] == "on-failure"
    assert settings["ProtectSystem"] == "strict" and settings["NoNewPrivileges"] == "yes"
    assert settings["User"] == "edgeinfer" and settings["RestartPreventExitStatus"] == "2"
    for key in ("LimitNOFILE", "WatchdogSec", "EnvironmentFile", "ExecReload"):
        assert key in settings, key


def test_example_network_loads() -> None:
    router_toml = EXAMPLES / "router.toml"
    fra = load_router_config(router_toml, env={})
    pops = load_pops(router_toml, fra.here)
    assert [p.name for p in pops] == ["fra", "ams", "waw"]
    ams = load_router_config(router_toml, env=read_env_file(EXAMPLES / "router.env"))
    assert ams.here == "ams" and load_pops(router_toml, ams.here) == pops

    daemons = {p.name: set(p.daemons) for p in pops}
    for role, env_file in [("prefill", None), ("decode", None), ("both", "daemon-both.env")]:
        env = read_env_file(EXAMPLES / env_file) if env_file else {}
        config = load_daemon_config(EXAMPLES / f"daemon-{role}.toml", env=env)
        assert config.role == role
        # Each daemon is listed by the routers under the PoP it reports.
        assert f"http://{config.advertise_host}:{config.port}" in daemons[config.pop]


def test_every_key_is_documented() -> None:
    doc = (ROOT / "docs" / "DEPLOY.md").read_text()
    keys = [f.name for f in dataclasses.fields(DaemonConfig)]
    keys += [f.name for f in dataclasses.fields(RouterConfig)]
    keys += list(_POP_KEYS)
    missing = [k for k in keys if f"`{k}`" not in doc]
    assert not missing, f"docs/DEPLOY.md does not describe {missing}"
