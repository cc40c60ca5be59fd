"""Whether a compiled CPU kernel runs, decided by timing it against the library call it replaces.

A hand-written kernel is faster on the CPU it was tuned on and can be several times slower on
another (``skinny_gemm`` ran at 0.1-0.7x oneDNN on an AVX2 EPYC). So each one is timed on the
host, on the model's shapes, against its baseline, and runs only where it wins by
:data:`MARGIN`. :class:`Chooser` times one :class:`Trial` (:func:`measure`: both sides in
alternating rounds, each round keeping a block's fastest call, the verdict the median of the
rounds' ratios) and keeps the result under ``<cache
dir>/kernel_choice``, in a file per CPU model, CPU flags and torch version, keyed inside by the
kernel's build (source hash and ``-march``), the case and the thread count; a restart reads it
instead of measuring. A timing taken while other work kept the cores busy (load average above
the core count) is kept too, but only stands in for a measurement while the host is still busy:
the first start on a quiet host measures it again. What was decided, and by how much, stays in
this process for the log and ``/v1/state`` (:func:`summary`).

``EDGEINFER_KERNEL_CHOICE``: ``measure`` (default; cached), ``remeasure`` (ignore the cache,
then overwrite it), ``off`` (no timing: every compiled kernel runs wherever it applies).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import os
import platform
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from edgeinfer.shared.cache_dir import cache_dir

log = logging.getLogger(__name__)

MARGIN = 1.1  # a kernel runs where baseline time / kernel time is at least this
ENV_MODE = "EDGEINFER_KERNEL_CHOICE"
MODES = ("measure", "remeasure", "off")
# Per case: rounds of (baseline block, kernel block); a block repeats its call for about BLOCK_S
# and keeps the fastest call; as many rounds as fit CASE_BUDGET_S, within [MIN_ROUNDS,
# MAX_ROUNDS], and none started past 4 x CASE_BUDGET_S.
BLOCK_S = 0.002
CASE_BUDGET_S = 0.03
MIN_ROUNDS, MAX_ROUNDS = 3, 9


def mode() -> str:
    value = os.environ.get(ENV_MODE, "").strip().lower() or "measure"
    if value not in MODES:
        raise ValueError(f"{ENV_MODE}={value!r}: expected one of {', '.join(MODES)}")
    return value


@dataclass(frozen=True)
class Trial:
    """One case of one kernel: ``setup()`` makes its inputs (only when it is measured) and
    returns two callables computing the same thing, the baseline's and the kernel's."""

    kernel: str  # the compiled library, e.g. "skinny_gemm"
    case: str  # what was timed, e.g. "3072x576 float32 x30, 4 rows"
    baseline: str  # what it replaces, e.g. "oneDNN"
    build: str  # native_build.build_id of the library: a measurement is valid for this build
    setup: Callable[[], tuple[Callable[[], object], Callable[[], object]]]


@dataclass(frozen=True)
class Timing:
    baseline_us: float  # medians per call
    kernel_us: float
    ratio: float  # median over rounds of baseline time / kernel time
    rounds: int


@dataclass(frozen=True)
class Verdict:
    kernel: str
    case: str
    baseline: str
    timing: Timing
    cached: bool  # read from the cache, not measured in this process

    @property
    def chosen(self) -> bool:
        return self.timing.ratio >= MARGIN


def _fastest(fn: Callable[[], object], calls: int) -> float:
    """The fastest of ``calls`` timed calls, in seconds."""
    best = math.inf
    clock = time.perf_counter
    for _ in range(calls):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return best


def measure(
    baseline: Callable[[], object],
    kernel: Callable[[], object],
    *,
    budget_s: float = CASE_BUDGET_S,
    min_rounds: int = MIN_ROUNDS,
    max_rounds: int = MAX_ROUNDS,
) -> Timing:
    """Both sides timed in alternating rounds (a benchmark passes a larger budget).

    A round times a block of calls of each side and keeps each block's fastest call: another
    process on the cores only ever adds time, and an OpenMP kernel whose second thread waits
    for a core can take a whole scheduler slice (~16 ms for a 20 us call on a loaded 2-core
    host); the fastest call of a block is the one that was not hit. The verdict is the median
    over rounds of their ratios, so a round where one side was unlucky throughout does not
    decide either.
    """
    # A warm-up call of each (JIT compilation, first touch of the inputs, oneDNN's primitives),
    # timed: an upper bound of a call, which sizes the blocks.
    slowest = max(_fastest(baseline, 1), _fastest(kernel, 1), 1e-7)
    calls = max(1, min(1000, math.ceil(BLOCK_S / slowest)))
    rounds = max(min_rounds, min(max_rounds, int(budget_s / (2 * calls * slowest))))
    base: list[float] = []
    mine: list[float] = []
    deadline = time.perf_counter() + 4 * budget_s
    while len(base) < rounds and (len(base) < min_rounds or time.perf_counter() < deadline):
        if len(base) % 2:
            k = _fastest(kernel, calls)
            b = _fastest(baseline, calls)
        else:
            b = _fastest(baseline, calls)
            k = _fastest(kernel, calls)
        base.append(b)
        mine.append(k)
    return Timing(
        baseline_us=statistics.median(base) * 1e6,
        kernel_us=statistics.median(mine) * 1e6,
        ratio=statistics.median(b / max(k, 1e-12) for b, k in zip(base, mine, strict=True)),
        rounds=len(base),
    )


def _cpu_identity() -> str:
    """The CPU's model name and feature flags (what a kernel's speed depends on)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    wanted = ("model name", "flags", "Features", "CPU part")  # x86, then aarch64 fields
    found: dict[str, str] = {}
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() in wanted:
            found.setdefault(key.strip(), value.strip())
    return "\n".join(f"{k}: {v}" for k, v in sorted(found.items())) or platform.machine()


def host_busy() -> bool:
    """Whether other work is keeping the cores busy (1-minute load average above their count):
    timings taken now describe a contended host."""
    try:
        return os.getloadavg()[0] > (os.cpu_count() or 1)
    except OSError:
        return False


def cache_path() -> Path:
    """The file of this host's measurements: one per CPU model and flags and torch version."""
    ident = f"{_cpu_identity()}\ntorch {torch.__version__}"
    digest = hashlib.sha256(ident.encode()).hexdigest()[:16]
    return cache_dir() / "kernel_choice" / f"{digest}.json"


def _read(path: Path) -> dict[str, dict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data.get("entries", {}) if isinstance(data, dict) else {}


def _write(path: Path, entries: Mapping[str, dict]) -> None:
    """Written beside and renamed into place: a racing process never reads half a file (the
    last writer wins; what it lacked is measured again next time)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"host": _cpu_identity(), "torch": torch.__version__, "entries": dict(entries)}
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
        json.dump(body, f, indent=1, sort_keys=True)
    os.replace(f.name, path)


# Every verdict of this process, latest per (kernel, case): what summary() reports.
_verdicts: dict[tuple[str, str], Verdict] = {}
_lock = threading.Lock()


class Chooser:
    """Times trials at ``threads`` torch threads, or reads their earlier timing from the cache."""

    def __init__(self, threads: int, *, path: Path | None = None) -> None:
        self.threads = threads
        self.path = path or cache_path()
        self._mode = mode()
        self._entries = {} if self._mode == "remeasure" else _read(self.path)
        self._dirty = False
        self.busy = host_busy()
        self.measured_s = 0.0  # time spent timing, this chooser

    def key(self, trial: Trial) -> str:
        return f"{trial.build}|{trial.case}|{self.threads} threads"

    def decide(self, trial: Trial) -> Verdict:
        key = self.key(trial)
        timing = self._cached(key)
        cached = timing is not None
        if timing is None:
            before = torch.get_num_threads()
            torch.set_num_threads(self.threads)
            start = time.perf_counter()
            try:
                with torch.inference_mode():
                    timing = measure(*trial.setup())
            finally:
                torch.set_num_threads(before)
                self.measured_s += time.perf_counter() - start
            self._entries[key] = {"timing": asdict(timing), "busy": self.busy}
            self._dirty = True
        verdict = Verdict(trial.kernel, trial.case, trial.baseline, timing, cached)
        with _lock:
            _verdicts[trial.kernel, trial.case] = verdict
        return verdict

    def _cached(self, key: str) -> Timing | None:
        entry = self._entries.get(key)
        if not isinstance(entry, dict) or (entry.get("busy") and not self.busy):
            return None  # none, or taken on a busy host and this one is quiet: measure
        try:
            return Timing(**entry["timing"])
        except (KeyError, TypeError):  # written by another version of this module
            return None

    def save(self) -> None:
        """Keep what this chooser measured (merged into what another process wrote since)."""
        if not self._dirty:
            return
        entries = _read(self.path) | self._entries
        try:
            _write(self.path, entries)
        except OSError as exc:  # a read-only cache dir: the next start measures again
            log.warning("could not save kernel timings to %s: %s", self.path, exc)
        self._dirty = False


class SizeRoute:
    """Whether a kernel runs at a problem size (rows, tokens, sequences), from its verdicts at
    a few measured sizes. A measured size takes its verdict; one between two measured sizes
    takes the kernel only where both chose it (no extrapolation in the kernel's favour: its
    edge grows with size for some kernels and shrinks for others); one below or above them all
    takes the nearest's. A lookup is one tuple index."""

    __slots__ = ("_last", "_table", "sizes")

    def __init__(self, verdicts: Mapping[int, bool]) -> None:
        if not verdicts or min(verdicts) < 1:
            raise ValueError(f"verdicts at sizes >= 1 needed, got sizes {sorted(verdicts)}")
        self.sizes = dict(sorted(verdicts.items()))
        measured = list(self.sizes.items())
        table = [measured[0][1]] * (measured[0][0] + 1)  # up to the smallest: its verdict
        for (_, low), (high_size, high) in itertools.pairwise(measured):
            table.extend([low and high] * (high_size - len(table)))
            table.append(high)
        self._table = tuple(table)
        self._last = measured[-1][1]

    def __call__(self, size: int) -> bool:
        return self._table[size] if size < len(self._table) else self._last

    @property
    def never(self) -> bool:
        return not any(self.sizes.values())


def powers_of_two(largest: int, *, step: int = 1, smallest: int = 1) -> list[int]:
    """``smallest, smallest * 2**step, ...`` up to ``largest`` (and ``smallest`` at least)."""
    sizes, size = [], smallest
    while size <= max(largest, smallest):
        sizes.append(size)
        size <<= step
    return sizes


def verdicts() -> list[Verdict]:
    with _lock:
        return list(_verdicts.values())


def clear() -> None:
    """Forget this process's verdicts (tests)."""
    with _lock:
        _verdicts.clear()


def summary() -> dict[str, dict]:
    """Per kernel: its baseline, and per case the time ratio against it, split by where the
    kernel was chosen and where the baseline was kept. Compact, for ``/v1/state``."""
    out: dict[str, dict] = {}
    for v in verdicts():
        entry = out.setdefault(
            v.kernel, {"baseline": v.baseline, "margin": MARGIN, "chosen": {}, "kept_baseline": {}}
        )
        entry["chosen" if v.chosen else "kept_baseline"][v.case] = round(v.timing.ratio, 2)
    return out


def describe() -> str:
    """One line per kernel for the log: the cases it runs in and lost, with their ratios."""
    lines = []
    for kernel, entry in summary().items():
        won, lost = entry["chosen"], entry["kept_baseline"]

        def span(ratios: dict[str, float]) -> str:
            low, high = min(ratios.values(), default=0), max(ratios.values(), default=0)
            return f"{low:.2f}x" if low == high else f"{low:.2f}-{high:.2f}x"

        parts = [f"{kernel}: runs in {len(won)} of {len(won) + len(lost)} cases"]
        if won:
            parts.append(f"at {span(won)} {entry['baseline']}'s speed")
        if lost:
            parts.append(f"{entry['baseline']} kept in {len(lost)} (kernel at {span(lost)})")
        lines.append(", ".join(parts))
    return "; ".join(lines)
