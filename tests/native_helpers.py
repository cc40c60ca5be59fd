"""The compiled CPU kernels in tests: skipped only where this host cannot build them.

A host without a C++ compiler, or with ``EDGEINFER_NATIVE_KERNELS=0``, skips the tests that
need a compiled kernel. A host with a compiler builds it here: a compile error fails the test
with the compiler's message instead of reading as "skipped".
"""

from __future__ import annotations

import platform

import pytest

from edgeinfer.kernels import native_build


def require_native(*names: str, march: str | None = None) -> None:
    """Skip without a compiler (or switched off); otherwise build and load ``names``, failing
    the test with the compiler's message where one does not build."""
    if not native_build.enabled():
        pytest.skip(f"{native_build.ENV_SWITCH}=0: the portable kernels serve")
    if native_build.compiler() is None:
        pytest.skip("no C++ compiler here: the portable kernels serve")
    if march not in (None, "native") and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"-march={march} names an x86-64 target")
    for name in names:
        native_build.build(name, march)  # raises NativeBuildError with the compiler's output
        if native_build.load(name, march) is None:
            pytest.fail(f"{name} built but did not load: {native_build.load_error(name, march)}")
