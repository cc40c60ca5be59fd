"""The router's compiled passes are cached under a digest of the package's sources, so a change
to a pass's callee (another module) compiles the caller again instead of loading stale code."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from edgeinfer.router import candidate_cut, jit, load_update, prefix_pairs, prefix_select
from edgeinfer.router.jit import package_digest, sources_digest


def test_the_digest_follows_every_source_file(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("X = 1\n")
    first = sources_digest(tmp_path)
    assert sources_digest(tmp_path) == first
    (tmp_path / "a.py").write_text("X = 2\n")  # same size, other content
    second = sources_digest(tmp_path)
    assert second != first
    (tmp_path / "b.py").write_text("")
    assert sources_digest(tmp_path) != second


def test_every_pass_is_stamped_with_the_package_digest() -> None:
    passes = [
        obj
        for module in (candidate_cut, load_update, prefix_pairs, prefix_select)
        for obj in vars(module).values()
        if hasattr(getattr(obj, "_cache", None), "_cache_file")  # inlined helpers have none
    ]
    assert len(passes) >= 8
    for dispatcher in passes:
        stamp = dispatcher._cache._cache_file._source_stamp
        assert stamp[1] == package_digest(), dispatcher


CALLEE = "from pkg.jit import compiled\n\n@compiled\ndef f(x):\n    return x + {}\n"
CALLER = (
    "from pkg.a import f\nfrom pkg.jit import compiled\n\n@compiled\ndef g(x):\n    return f(x)\n"
)


def test_a_changed_callee_is_compiled_into_its_unchanged_caller(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    shutil.copy(jit.__file__, pkg / "jit.py")
    (pkg / "b.py").write_text(CALLER)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(tmp_path)}
    run = [sys.executable, "-c", "from pkg.b import g; print(g(1))"]
    answers = []
    for added in (10, 20):
        (pkg / "a.py").write_text(CALLEE.format(added))  # b.py stays as it was
        out = subprocess.run(run, env=env, capture_output=True, text=True, check=True, timeout=120)
        answers.append(out.stdout.strip())
    assert answers == ["11", "21"], textwrap.shorten(str(answers), 200)
    assert any((tmp_path / "cache").rglob("*.nbi"))  # the cache was used, not bypassed
