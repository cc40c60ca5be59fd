"""Compile the C++ CPU kernels in ``csrc/`` once per host and load them with ctypes.

Why not ``torch.utils.cpp_extension``: its builds include torch's headers (tens of seconds per
kernel, a ninja dependency) for kernels that need none of them. These are plain functions over
raw pointers: ``g++`` builds one in about a second. A library is compiled for this CPU
(``-march=native``; ``EDGEINFER_NATIVE_MARCH`` or :func:`build`'s ``march`` name another target,
e.g. ``x86-64-v3`` to try the AVX2 code on an AVX-512 host), with OpenMP, and cached under
``<cache dir>/kernels`` by a hash of its source and the folder's headers, the flags, the
compiler's version and the CPU's feature flags, so a host with a different CPU or compiler
never loads a stale build, and each target gets its own file.

OpenMP: the library needs ``libgomp.so.1``, the soname of the copy torch bundles and has
already loaded (torch is imported first, below), so the dynamic loader binds it to torch's
runtime and a parallel region runs on torch's own threads. :func:`load` checks that in the
process's memory map and refuses a library that brought a second OpenMP runtime: two pools
spinning on the same cores slow every matmul.

A host without a compiler, or with ``EDGEINFER_NATIVE_KERNELS=0``, gets ``None``: callers keep
a portable kernel (numba's, torch's) for that case. A build that fails on a host with a
compiler also gets ``None`` at run time (logged), and :func:`load_error` keeps the compiler's
message so that tests can tell a compile regression from a host without a compiler.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # noqa: F401  # loads torch's libgomp.so.1 before any library here needs one

from edgeinfer.shared.cache_dir import cache_dir

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
COMPILE_FLAGS = ("-O3", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++17")  # and -march
# Linked in a second command without -ffast-math: linking with it adds crtfastmath.o, whose
# constructor turns on flush-to-zero and denormals-are-zero for the whole process at load
# time, silently changing every float computation outside the kernel too.
LINK_FLAGS = ("-shared", "-fopenmp")
ENV_SWITCH = "EDGEINFER_NATIVE_KERNELS"  # "0" turns the compiled kernels off
ENV_MARCH = "EDGEINFER_NATIVE_MARCH"  # the -march target of the libraries (default: native)
# x86-64-v2: SSE4.2 (16-byte vectors), v3: AVX2 + FMA, native: this CPU (AVX-512 where it has it).
MARCHES = ("x86-64-v2", "x86-64-v3", "native")
COMPILE_TIMEOUT_S = 120


class NativeBuildError(RuntimeError):
    """A kernel source did not compile or load."""


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def default_march() -> str:
    return os.environ.get(ENV_MARCH, "").strip() or "native"


@functools.cache
def _host_fingerprint(cxx: str) -> str:
    """The compiler's version and the CPU's feature flags: what ``-march=native`` depends on."""
    version = subprocess.run(
        [cxx, "--version"], capture_output=True, text=True, timeout=30, check=False
    ).stdout
    try:
        cpu_flags = next(
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        cpu_flags = os.uname().machine
    return version + cpu_flags


def build(name: str, march: str | None = None, defines: tuple[str, ...] = ()) -> Path:
    """Compile ``csrc/<name>.cpp`` for ``-march=<march>`` (default :func:`default_march`), once
    per source and headers, flags, compiler and CPU; the library. ``defines`` (``NAME=VALUE``,
    as ``-D``) build a variant beside the one the engine loads: benches compare the two."""
    cxx = compiler()
    if cxx is None:
        raise NativeBuildError("no C++ compiler (g++ or $CXX) on PATH")
    march = march or default_march()
    flags = (*COMPILE_FLAGS, f"-march={march}", *(f"-D{d}" for d in defines))
    source = CSRC / f"{name}.cpp"
    if not source.exists():
        raise NativeBuildError(f"no kernel source {source}")
    digest = hashlib.sha256(
        b"".join(f.read_bytes() for f in (source, *sorted(CSRC.glob("*.h"))))  # with its headers
        + " ".join(flags + LINK_FLAGS).encode()
        + _host_fingerprint(cxx).encode()
    ).hexdigest()[:16]
    suffix = "" if march == "native" else f"-{march}"
    target = cache_dir() / "kernels" / f"{name}{suffix}-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed into place: processes that race here each build
    # their own file and the last rename wins; none can load a half-written library.
    with tempfile.TemporaryDirectory(prefix=f".{name}-", dir=target.parent) as work:
        obj, lib = Path(work) / f"{name}.o", Path(work) / f"{name}.so"
        for command in (
            [cxx, *flags, "-c", "-o", str(obj), str(source)],
            [cxx, *LINK_FLAGS, "-o", str(lib), str(obj)],
        ):
            result = subprocess.run(
                command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S, check=False
            )
            if result.returncode:
                raise NativeBuildError(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
        os.replace(lib, target)
    log.info("compiled %s into %s", source.name, target)
    return target


def build_id(name: str) -> str | None:
    """The loaded library's file stem (``<name>[-<march>]-<hash>``): what a measurement of
    the kernel is valid for; None where it is not built."""
    if load(name) is None:
        return None
    return build(name).stem


def _openmp_runtimes() -> set[str]:
    """Distinct files of OpenMP runtimes mapped into this process."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return set()
    return {
        line.split()[-1]
        for line in maps.splitlines()
        if "libgomp" in line or "libiomp" in line or "libomp" in line
    }


# (name, march) -> why the last load() of it gave None; cleared by a successful load.
_errors: dict[tuple[str, str], str] = {}


def load_error(name: str, march: str | None = None) -> str | None:
    """Why :func:`load` gave None for this library (the compiler's message for a failed build),
    or None where it loaded or was not tried."""
    return _errors.get((name, march or default_march()))


def load(name: str, march: str | None = None) -> ctypes.CDLL | None:
    """The compiled library ``name`` (for ``march``, default :func:`default_march`), or None
    (switched off, no compiler, a failed build, or a second OpenMP runtime); the reason is
    logged once and kept for :func:`load_error`."""
    return _load(name, march or default_march())


@functools.cache
def _load(name: str, march: str) -> ctypes.CDLL | None:
    if not enabled():
        _errors[name, march] = f"switched off by {ENV_SWITCH}"
        return None
    before = _openmp_runtimes()
    try:
        lib = ctypes.CDLL(str(build(name, march)))
    except (NativeBuildError, OSError, subprocess.SubprocessError) as exc:
        log.warning("native kernel %s unavailable, using the portable one: %s", name, exc)
        _errors[name, march] = str(exc)
        return None
    if before and (extra := _openmp_runtimes() - before):
        _errors[name, march] = f"brought a second OpenMP runtime: {', '.join(sorted(extra))}"
        log.warning(
            "native kernel %s brought its own OpenMP runtime (%s beside %s); not using it",
            name,
            ", ".join(sorted(extra)),
            ", ".join(sorted(before)),
        )
        return None
    _errors.pop((name, march), None)
    return lib


def clear_cache() -> None:
    """Forget loaded libraries and host facts (tests that change the environment)."""
    _load.cache_clear()
    _host_fingerprint.cache_clear()
    _errors.clear()
