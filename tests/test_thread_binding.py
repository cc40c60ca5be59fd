"""The engine thread's torch threads are bound one per CPU, only when that is unambiguous.

Each check runs in a child process limited to two CPUs, so that binding never touches this
process's threads and the host's core count does not matter (beyond having two).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux and two CPUs",
)

_PRELUDE = """
import os, threading, torch
CPUS = sorted(os.sched_getaffinity(0))[:2]
os.sched_setaffinity(0, CPUS)
torch.set_num_threads(2)

def affinities():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        out[int(tid)] = sorted(os.sched_getaffinity(int(tid)))
    return out

def in_thread(fn):
    result = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    thread.join()
    return result[0]
"""


def _run(body: str) -> str:
    code = _PRELUDE + textwrap.dedent(body)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_a_team_as_large_as_the_cpus_is_bound_one_thread_per_cpu() -> None:
    out = _run("""
        from edgeinfer.daemon.engine.thread_binding import bind_omp_team

        def bind():
            cpus = bind_omp_team(2)
            me = threading.get_native_id()
            torch.ones(256, 256) @ torch.ones(256, 256)  # the team it bound runs this
            mine = affinities()[me]
            pinned = sorted(a for t, a in affinities().items() if t != me and len(a) == 1)
            # Still right after binding: a product computed on the bound team.
            ok = bool((torch.ones(64, 64) @ torch.ones(64, 64) == 64).all())
            return cpus, mine, pinned, ok

        cpus, mine, pinned, ok = in_thread(bind)
        print(cpus == CPUS, mine == [CPUS[0]], pinned == [[CPUS[1]]], ok)
        # The main thread's own team is untouched.
        print(affinities()[threading.get_native_id()] == CPUS)
    """)
    assert out.splitlines() == ["True True True True", "True"]


def test_nothing_is_bound_unless_the_team_matches_the_cpus() -> None:
    out = _run("""
        from edgeinfer.daemon.engine.thread_binding import bind_omp_team

        print(in_thread(lambda: bind_omp_team(3)), in_thread(lambda: bind_omp_team(1)))
        print(all(a == CPUS for a in affinities().values()))
    """)
    assert out.splitlines() == ["None None", "True"]


def test_the_stepping_thread_binds_unless_configured_not_to(tmp_path: Path) -> None:
    out = _run(f"""
        import asyncio, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from daemon_helpers import NUM_KV_BLOCKS, build_checkpoint
        from edgeinfer.daemon.engine.async_engine import AsyncEngine
        from edgeinfer.daemon.engine.config import EngineConfig
        from edgeinfer.daemon.engine.llm_engine import LLMEngine
        from edgeinfer.daemon.engine.sampling_params import SamplingParams
        from pathlib import Path

        checkpoint = build_checkpoint(Path({str(tmp_path)!r}))

        def serve(bind):
            config = EngineConfig(model=str(checkpoint), num_kv_blocks=NUM_KV_BLOCKS,
                                  device="cpu", num_threads=2, bind_threads=bind)
            engine = LLMEngine(config)

            async def main():
                runner = AsyncEngine(engine)
                seen = []
                runner.on_step = lambda *_: seen.append(
                    sorted(os.sched_getaffinity(threading.get_native_id())))
                runner.start()
                params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
                async for _ in runner.generate("r", [5, 6, 7], params):
                    pass
                await runner.stop()
                return seen

            return asyncio.run(main())

        print(all(s == [CPUS[0]] for s in serve(True)), all(s == CPUS for s in serve(False)))
    """)
    assert out == "True True"
