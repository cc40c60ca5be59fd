"""Bind the engine thread's OpenMP team to one CPU per thread, as vLLM's CPU backend does.

A step's parallel regions end at a barrier that waits for every thread of the team. Unbound,
the scheduler may put two threads of one team on the same core: a worker that slept between
steps is woken by the engine thread, placed next to it when its own core is busy for a moment
(another process, the event loop), and stays there. Then each barrier costs whole time slices:
the thread at the barrier spins (libgomp spins ~300k pauses before it sleeps) while the one it
waits for cannot run. Traced on a 2-core host (``perf sched``, 8 streams while 4 clients post
16 MiB prompts, ``bench/hostile_prompts.py``): both torch threads shared one core in 4 ms
slices while the other core sat idle, and steps of ~1 ms took 20-40 ms. With the team bound,
the longest token gap under that attack fell from 39.9 ms to 20.3 ms, and gaps over 15 ms
from 52 to 9 in 15 s.

Binding is done only where it is unambiguous: a team of as many threads as the CPUs this
process may use (``sched_getaffinity``: a systemd ``CPUAffinity=`` or a cpuset narrows it),
at least two, on libgomp (torch's OpenMP on Linux). Thread ``i`` of the team goes to the
``i``-th allowed CPU. libgomp has no call for this, so the team runs a callback on every thread
(``GOMP_parallel``, the entry point its compiler-generated code uses) that sets that thread's
own affinity; the workers keep it for the team's life, which is the engine thread's.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def _loaded_libgomp() -> ctypes.CDLL | None:
    """The libgomp this process has loaded (torch's own copy first, should a system copy be
    loaded beside it), or None."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = {p for line in maps.splitlines() if "/libgomp" in (p := line.rpartition(" ")[2])}
    for path in sorted(paths, key=lambda p: "/torch/" not in p):
        try:
            return ctypes.CDLL(path)  # already loaded: the same instance torch uses
        except OSError:
            continue
    return None


def bind_omp_team(threads: int) -> list[int] | None:
    """Bind the calling thread's OpenMP team of ``threads`` threads, thread ``i`` to the
    ``i``-th CPU this process may use (the calling thread is thread 0). Returns the CPUs, or
    None when nothing was bound (see the module docstring for when)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if threads < 2 or threads != len(cpus):
        return None
    gomp = _loaded_libgomp()
    if gomp is None:
        return None
    thread_num = gomp.omp_get_thread_num
    thread_num.restype = ctypes.c_int
    # Appended to by every thread of the team: each callback holds the GIL while it runs.
    bound: list[int] = []
    failed: list[BaseException] = []

    def bind(_: int | None) -> None:
        i = thread_num()
        try:
            os.sched_setaffinity(0, {cpus[i]})  # 0: this thread (Linux affinity is per thread)
        except (OSError, IndexError) as exc:
            failed.append(exc)
            return
        bound.append(cpus[i])

    callback = _CALLBACK(bind)
    parallel = gomp.GOMP_parallel
    parallel.argtypes = [_CALLBACK, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    parallel.restype = None
    parallel(callback, None, threads, 0)  # ctypes releases the GIL; each callback takes it
    if failed or len(bound) != threads:
        log.warning("torch threads left unbound: %s", failed[0] if failed else "team too small")
        os.sched_setaffinity(0, cpus)  # this thread as it was; a bound worker stays harmless
        return None
    return sorted(bound)
