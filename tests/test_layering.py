"""Architecture rules: the engine speaks no network; router and shared never load torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

RULES = [
    (ROOT / "edge-daemon/edgeinfer/daemon/engine", {"aiohttp", "zmq"}),
    (ROOT / "router/edgeinfer/router", {"torch"}),
    (ROOT / "shared/edgeinfer/shared", {"torch"}),
]


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize(("package", "forbidden"), RULES, ids=lambda v: getattr(v, "name", ""))
def test_no_forbidden_imports(package: Path, forbidden: set[str]) -> None:
    files = sorted(package.rglob("*.py"))
    assert files, f"no sources under {package}"
    offenders = {str(f.relative_to(ROOT)): sorted(_imported_roots(f) & forbidden) for f in files}
    offenders = {f: mods for f, mods in offenders.items() if mods}
    assert not offenders, f"forbidden imports: {offenders}"


def _modules(package: Path, prefix: str) -> list[str]:
    mods = []
    for f in sorted(package.rglob("*.py")):
        rel = f.relative_to(package).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        mods.append(".".join([prefix, *parts]))
    return mods


def test_router_and_shared_do_not_load_torch_transitively() -> None:
    mods = _modules(ROOT / "router/edgeinfer/router", "edgeinfer.router")
    mods += _modules(ROOT / "shared/edgeinfer/shared", "edgeinfer.shared")
    code = (
        "import importlib, sys\n"
        f"for m in {mods!r}: importlib.import_module(m)\n"
        "bad = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "", f"importing router/shared loaded: {out.stdout.strip()}"
