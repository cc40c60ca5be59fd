"""Worker ranks: the process loop of ranks 1..N-1 and rank 0's handle on them.

A worker connects to rank 0's TCPStore, loads its shard, then obeys commands that rank 0
broadcasts on the control group (:class:`Command`) until told to stop. Failures travel two
ways: a worker that cannot load writes its error into the store; one that dies later is seen by
rank 0's watchdog (the process sentinel) and, mid-step, as a closed socket in the collective.
A worker whose parent is gone exits instead of waiting forever on a collective.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

import torch
from torch.distributed import TCPStore

from edgeinfer.daemon.engine.errors import EngineError
from edgeinfer.daemon.engine.parallel.comm import LOOPBACK, Comm
from edgeinfer.daemon.engine.parallel.progress import LoadDisplay, StoreProgress
from edgeinfer.daemon.engine.parallel.shard import RankSpec, ShardRunner, rank_device

log = logging.getLogger(__name__)

# ("step", [MicroBatch]) | ("read_kv", block_ids, layers) | ("write_kv", block_ids, layer)
# | ("stop",): what rank 0 broadcasts; every rank then runs its part of it.
Command = tuple[Any, ...]

# Building a model on the meta device imports torch._dynamo on first use (its random init
# goes through torch._refs), which takes seconds: import it once, in the fork server.
_PRELOAD = ("torch._dynamo",)
_POLL_S = 0.1
_STOP_GRACE_S = 5.0


def cpu_threads(spec: RankSpec) -> int:
    """Intra-op threads per rank on the CPU: the cores shared out, unless configured."""
    return spec.engine.num_threads or max(1, (os.cpu_count() or 1) // spec.layout.world_size)


def serve(shard: ShardRunner) -> None:
    """Run rank 0's commands until ``stop`` (a worker's whole life after loading)."""
    while True:
        cmd: Command = shard.comm.broadcast_object()
        if cmd[0] == "step":
            shard.step(cmd[1])
        elif cmd[0] == "read_kv":
            shard.send_kv(cmd[1], cmd[2])
        elif cmd[0] == "write_kv":
            shard.recv_kv(cmd[1], cmd[2])
        else:
            return


def _exit_with_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)  # orphaned: an NCCL collective would otherwise wait forever

    threading.Thread(target=watch, name="edgeinfer-parent-watch", daemon=True).start()


def worker_main(spec: RankSpec, rank: int) -> None:
    """Entry point of a spawned rank."""
    _exit_with_parent()
    world = spec.layout.world_size
    store = TCPStore(LOOPBACK, spec.store_port, world, False, timeout=timedelta(seconds=60))
    device = rank_device(spec.engine, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(cpu_threads(spec))
    try:
        comm = Comm(spec.layout, rank, device)
        shard = ShardRunner(spec, rank, comm, StoreProgress(store))
        store.set(f"loaded/{rank}", "1")
        comm.connect(store)
    except Exception as exc:  # reported to rank 0, which raises it as the engine's error
        with contextlib.suppress(Exception):
            store.set(f"error/{rank}", f"{type(exc).__name__}: {exc}")
        sys.exit(1)
    try:
        serve(shard)
    except Exception as exc:  # rank 0 or a peer went away mid-command
        print(f"edgeinfer rank {rank}: stopping: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)


class WorkerPool:
    """Rank 0's handle on ranks 1..N-1: spawn, wait until loaded, watch, stop."""

    def __init__(self, spec: RankSpec, store: TCPStore) -> None:
        self.store = store
        self.failure: str | None = None
        self._closing = False
        # forkserver: one server imports torch and this module once per process lifetime, and
        # every worker forks from it (no CUDA or threads there, unlike this process). Spawning
        # would pay the torch import again for each worker of each engine.
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([__name__, *_PRELOAD])
        self.procs = [
            ctx.Process(target=worker_main, args=(spec, r), name=f"edgeinfer-rank{r}", daemon=True)
            for r in range(1, spec.layout.world_size)
        ]
        for p in self.procs:
            p.start()

    def _dead(self) -> str | None:
        for rank, p in enumerate(self.procs, start=1):
            if p.exitcode is not None:
                return f"rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
        return None

    def wait_loaded(self, display: LoadDisplay) -> None:
        """Block until every worker has loaded its shard; raise the first worker's error."""
        pending = set(range(1, len(self.procs) + 1))
        while pending:
            for rank in sorted(pending):
                if self.store.check([f"error/{rank}"]):
                    message = self.store.get(f"error/{rank}").decode()
                    raise EngineError(f"rank {rank} failed to load: {message}")
                if self.store.check([f"loaded/{rank}"]):
                    pending.discard(rank)
            dead = self._dead()
            if pending and dead is not None:
                raise EngineError(f"a worker died while loading: {dead}")
            display.refresh()
            time.sleep(_POLL_S if pending else 0)

    def watch(self, on_death: Callable[[], None]) -> None:
        """Start a watchdog thread: a worker exiting records ``failure`` and calls
        ``on_death()`` (which unblocks collectives that would wait for it)."""

        def run() -> None:
            while not self._closing:
                wait([p.sentinel for p in self.procs], timeout=0.5)
                dead = self._dead()
                if dead is not None and not self._closing:
                    self.failure = dead
                    log.error("parallel engine: %s", dead)
                    on_death()
                    return

        threading.Thread(target=run, name="edgeinfer-rank-watchdog", daemon=True).start()

    def failed(self, exc: BaseException) -> EngineError:
        """The error for a collective that failed: names the dead rank when there is one."""
        deadline = time.monotonic() + 2.0
        while self.failure is None and self._dead() is None and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        self.failure = self.failure or self._dead() or f"a collective failed: {exc}"
        return EngineError(f"parallel engine failed: {self.failure}")

    def close(self) -> None:
        self._closing = True
        deadline = time.monotonic() + _STOP_GRACE_S
        for p in self.procs:
            p.join(max(deadline - time.monotonic(), 0))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()
