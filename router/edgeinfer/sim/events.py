"""Event kinds, the event queue, the per-request state and the settings of a simulation.

Events are plain tuples ``(time, seq, kind, a, b, c)`` on a heap: ``seq`` makes the order total
and deterministic (equal times run in the order they were scheduled) and nothing past it is
ever compared. Arrivals are not on the heap: they are already sorted, so the loop merges them
in, which saves a push and a pop per request.

Requests are columns of plain lists indexed by request id: reading a Python list is several
times cheaper than indexing a numpy array element by element, and the loop does it per event.
"""

from __future__ import annotations

import dataclasses
import heapq

import numpy as np

from edgeinfer.router.network import NetworkModel

# Event kinds; a, b, c are ints/floats whose meaning depends on the kind.
STEP_END = 1  # a: engine, b: its step id (a cut or a failure voids older ones)
AT_DECODE = 2  # a: request reaches its decode engine
AT_PREFILL = 3  # a: request's prefill job reaches its prefill engine
KV_ARRIVED = 4  # a: request's KV pages are all at its decode engine
HEARTBEAT = 5  # a: engine
POP_FAIL = 6  # a: PoP index
POP_RECOVER = 7  # a: PoP index
POP_DRAIN = 8  # a: PoP index, b: 1 drain, 0 undrain
BUCKET = 9  # utilisation sample boundary
STATS = 10  # a: engine refreshes the load snapshot its heartbeats report
PULLED = 11  # a: request's prefix pages pulled from its decode engine are at its prefill engine,
# b: the prompt tokens its prefill job starts at

# Request status codes (Requests.status).
PENDING, DONE, FAILED, REJECTED = 0, 1, 2, 3


class EventQueue:
    def __init__(self) -> None:
        self.heap: list[tuple[float, int, int, int, int, float]] = []
        self.seq = 0

    def push(self, t: float, kind: int, a: int = 0, b: int = 0, c: float = 0.0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, a, b, c))

    def next_time(self) -> float:
        return self.heap[0][0] if self.heap else float("inf")

    def pop(self) -> tuple[float, int, int, int, int, float]:
        return heapq.heappop(self.heap)


class Requests:
    """Per-request columns; times are seconds of simulated time at the decode engine."""

    def __init__(self, prompt: list[int], output: list[int], block_size: int) -> None:
        n = len(prompt)
        self.prompt, self.output = prompt, output
        # KV blocks reserved at admission: the prompt and every token it will generate.
        self.blocks = [-(-(p + o) // block_size) for p, o in zip(prompt, output)]
        self.decode = [-1] * n  # engine index
        self.prefill = [-1] * n  # engine index; -1: the decode engine prefills
        self.first = [0.0] * n  # first token at the decode engine
        self.last = [0.0] * n  # last token at the decode engine
        self.net = [0.0] * n  # client <-> decode engine RTT this request saw
        self.status = [PENDING] * n
        self.attempts = [0] * n  # placements tried (connect failures move on to the next)

    def arrays(self) -> dict[str, np.ndarray]:
        return {
            "decode": np.asarray(self.decode, dtype=np.int64),
            "prefill": np.asarray(self.prefill, dtype=np.int64),
            "first": np.asarray(self.first),
            "last": np.asarray(self.last),
            "net": np.asarray(self.net),
            "status": np.asarray(self.status, dtype=np.int64),
        }


@dataclasses.dataclass(frozen=True)
class Outage:
    pop: str
    start_s: float
    end_s: float | None = None  # None: to the end
    kind: str = "fail"  # "fail": power off, in-flight work is lost; "drain": admin drain


@dataclasses.dataclass(frozen=True)
class SimConfig:
    seed: int = 0
    heartbeat_interval_s: float = 5.0
    # Heartbeat phases are rounded to this: the router's arrays are rebuilt once per slot, not
    # per heartbeat (<= 1% of a period of extra staleness; 20x fewer rebuilds at 1000 daemons).
    heartbeat_slot_s: float = 0.05
    net: NetworkModel = dataclasses.field(default_factory=NetworkModel)
    jitter_sigma: float = 0.15  # log-normal sigma of RTT / floor
    kv_tokens_per_gpu: int = 300_000  # ~40 GB of bf16 Llama-3-8B KV
    max_seqs: int = 128
    connect_timeout_s: float = 0.5  # what a placement on a dead daemon costs before the next
    outages: tuple[Outage, ...] = ()
    bucket_s: float = 60.0  # utilisation timeline resolution
    drain_limit_s: float = 600.0  # after the last arrival, stop waiting for stragglers
