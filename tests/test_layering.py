"""What importing a package loads at run time: the engine no network stack, the rest no torch.

The static import rules (package layers, the engine's and the router's forbidden imports) are
import-linter contracts in pyproject.toml, run by `make lint`. import-linter follows imports
only through edgeinfer's own modules; this test imports every module and looks at what a
third-party package pulled in behind them (e.g. a library that imports torch itself).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

RULES = [
    ("edge-daemon/edgeinfer/daemon/engine", "edgeinfer.daemon.engine", ("aiohttp", "zmq")),
    ("router/edgeinfer/router", "edgeinfer.router", ("torch", "transformers")),
    ("router/edgeinfer/ctl", "edgeinfer.ctl", ("torch", "transformers")),
    ("router/edgeinfer/sim", "edgeinfer.sim", ("torch", "transformers")),
    ("shared/edgeinfer/shared", "edgeinfer.shared", ("torch", "transformers")),
]


def _modules(package: Path, prefix: str) -> list[str]:
    mods = []
    for f in sorted(package.rglob("*.py")):
        rel = f.relative_to(package).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        mods.append(".".join([prefix, *parts]))
    return mods


@pytest.mark.parametrize(("path", "prefix", "forbidden"), RULES, ids=[r[1] for r in RULES])
def test_importing_a_package_loads_nothing_forbidden(
    path: str, prefix: str, forbidden: tuple[str, ...]
) -> None:
    mods = _modules(ROOT / path, prefix)
    assert mods, f"no sources under {path}"
    code = (
        "import importlib, sys\n"
        f"for m in {mods!r}: importlib.import_module(m)\n"
        f"print(','.join(sorted(m for m in {forbidden!r} if m in sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "", f"importing {prefix} loaded: {out.stdout.strip()}"
