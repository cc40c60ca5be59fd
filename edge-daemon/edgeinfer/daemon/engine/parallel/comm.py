"""The process groups of one rank, created directly so several engines can share a process.

No ``init_process_group``: each engine builds its own groups on its own ``TCPStore``, so a test
(or a benchmark) can hold a parallel engine next to a single-process one, or two parallel ones.
Three groups per rank:

* ``ctrl`` (gloo, every rank): rank 0 broadcasts commands and moves KV pages. Workers wait on
  it while the engine is idle, so its timeout is effectively infinite; a dead peer still shows
  at once as a closed socket.
* ``world`` (gloo on the CPU, NCCL on CUDA): stage-to-stage hidden states and logits.
* ``tp`` (same backend, the ranks of one stage): the all-reduces and all-gathers of TP.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, Store

from edgeinfer.daemon.engine.parallel.layout import ParallelLayout

# A collective that waits this long for its peers means one of them is stuck or gone.
COMPUTE_TIMEOUT = timedelta(minutes=5)
_IDLE_TIMEOUT = timedelta(days=3650)
LOOPBACK = "127.0.0.1"


def _gloo(store: Store, prefix: str, rank: int, size: int, timeout: timedelta) -> Any:
    opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # missing from the stubs
    # Every rank runs on this machine: loopback needs no hostname resolution or NIC choice.
    opts._devices = [ProcessGroupGloo.create_device(hostname=LOOPBACK)]
    opts._timeout = timeout
    return ProcessGroupGloo(PrefixStore(prefix, store), rank, size, opts)


def _compute_group(store: Store, prefix: str, rank: int, size: int, device: torch.device) -> Any:
    if device.type != "cuda":
        return _gloo(store, prefix, rank, size, COMPUTE_TIMEOUT)
    from torch.distributed import ProcessGroupNCCL

    opts = ProcessGroupNCCL.Options()
    opts._timeout = COMPUTE_TIMEOUT
    return ProcessGroupNCCL(PrefixStore(prefix, store), rank, size, opts)


@dataclass
class CommStats:
    """What this rank moved in steps, and the host time it spent blocked on it (on CUDA the
    collectives are asynchronous, so ``wait_s`` there counts launches, not transfers)."""

    all_reduce_bytes: int = 0
    all_gather_bytes: int = 0  # this rank's contribution
    recv_bytes: int = 0  # hidden states and logits from other stages
    wait_s: float = 0.0


class Comm:
    """One rank's groups. Created before the weights load (the sharded modules keep a
    reference) and connected after, so a rank that fails to load is seen before any rank
    blocks in a group's rendezvous."""

    def __init__(self, layout: ParallelLayout, rank: int, device: torch.device) -> None:
        self.layout = layout
        self.rank = rank
        self.device = device
        self.stage, self.tp_rank = layout.coords(rank)
        self.ctrl: Any = None
        self.world: Any = None
        self.tp: Any = None
        self.stats = CommStats()

    def connect(self, store: Store) -> None:
        """Rendezvous with every other rank (blocks until all of them call it)."""
        size, device = self.layout.world_size, self.device
        self.ctrl = _gloo(store, "ctrl", self.rank, size, COMPUTE_TIMEOUT)
        # Workers wait on ``ctrl`` for as long as the engine is idle.
        self.ctrl._set_default_timeout(_IDLE_TIMEOUT)
        self.world = _compute_group(store, "world", self.rank, size, device)
        if self.layout.tp > 1:
            self.tp = _compute_group(store, f"tp{self.stage}", self.tp_rank, self.layout.tp, device)

    # ---- tensor parallelism (within a stage) --------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the stage's TP ranks, in place."""
        if self.tp is not None:
            start = time.perf_counter()
            self.tp.allreduce([x]).wait()
            self.stats.wait_s += time.perf_counter() - start
            self.stats.all_reduce_bytes += x.numel() * x.element_size()
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every TP rank's ``x`` (equal shapes) along ``dim``, in rank order."""
        if self.tp is None:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.layout.tp)]
        start = time.perf_counter()
        self.tp.allgather([parts], [x]).wait()
        self.stats.wait_s += time.perf_counter() - start
        self.stats.all_gather_bytes += x.numel() * x.element_size()
        return torch.cat(parts, dim)

    # ---- pipeline parallelism (between stages) ------------------------------------------
    def isend(self, x: torch.Tensor, dst: int, tag: int) -> Any:
        """Start sending ``x`` to global rank ``dst``; keep ``x`` alive until ``wait()``."""
        return self.world.send([x], dst, tag)

    def recv(self, x: torch.Tensor, src: int, tag: int) -> torch.Tensor:
        start = time.perf_counter()
        self.world.recv([x], src, tag).wait()
        self.stats.wait_s += time.perf_counter() - start
        self.stats.recv_bytes += x.numel() * x.element_size()
        return x

    # ---- control (rank 0 to everyone) ---------------------------------------------------
    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0 sends ``obj`` (pickled, CPU tensors inside) to every rank; all return it."""
        if self.rank == 0:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            size = torch.empty(1, dtype=torch.int64)
        self.ctrl.broadcast(size, 0).wait()
        if self.rank != 0:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self.ctrl.broadcast(payload, 0).wait()
        return obj if self.rank == 0 else pickle.loads(payload.numpy().tobytes())

    def ctrl_send(self, x: torch.Tensor, dst: int, tag: int) -> None:
        self.ctrl.send([x.contiguous()], dst, tag).wait()

    def ctrl_recv(self, x: torch.Tensor, src: int, tag: int) -> torch.Tensor:
        self.ctrl.recv([x], src, tag).wait()
        return x

    def abort(self) -> None:
        """Make collectives stuck on a dead peer fail (NCCL would wait out its timeout)."""
        if self.device.type != "cuda":
            return  # gloo already fails on the dead peer's closed socket
        for group in (self.tp, self.world):
            if group is not None:
                group.abort()
