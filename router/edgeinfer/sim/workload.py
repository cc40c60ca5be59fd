"""Requests: when, how long, and from where.

Lengths and arrival patterns come from the Azure LLM inference traces (2023: ``code`` and
``conv``, one hour each), from synthetic mixes, or from a prefix-sharing trace in the Mooncake
FAST'25 format (``mooncake_trace``: the prompt as chained block keys, so requests share
prefixes); ``spread`` then places every request on the globe. An Azure trace is scaled by
overlaying time-shifted copies (keeping its burstiness and its length distribution) and thinned
by the diurnal curve of the regions that are awake. A prefix trace is scaled by compressing its
time instead (``compress``: copies would share each other's prefixes) and is not thinned; its
requests sharing a first block (a conversation, or users of one document) come from one place.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime as dt
import json
import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import numpy.typing as npt

from edgeinfer.sim import SimError
from edgeinfer.sim.topology import METROS

# The traces live beside the repository (../shared/data/traces), not in it.
TRACE_DIR = Path(__file__).resolve().parents[4] / "shared" / "data" / "traces"
AZURE_DIR = TRACE_DIR / "azure_llm_2023"
MOONCAKE_TRACE = TRACE_DIR / "mooncake" / "synthetic_trace.jsonl"
FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
MAX_PROMPT, MAX_OUTPUT = 16_000, 2_000  # the modelled engine's context, with room to decode
Blocks = tuple[tuple[int, ...], ...]  # per request: its prompt's chained block keys


@dataclasses.dataclass(frozen=True)
class Lengths:
    """A length-and-arrival pattern before it is placed on the globe."""

    t: FloatArray  # arrival seconds from 0, sorted
    prompt: IntArray
    output: IntArray
    name: str
    blocks: Blocks | None = None  # a prefix-sharing trace's block keys, else None

    @property
    def duration_s(self) -> float:
        return float(self.t[-1]) if len(self.t) else 0.0


@dataclasses.dataclass(frozen=True)
class Workload:
    t: FloatArray
    prompt: IntArray
    output: IntArray
    lat: FloatArray
    lon: FloatArray
    region: list[str]  # per request: a key of the region mix
    name: str
    span_s: float  # the window arrivals were drawn over (goodput is per second of it)
    start_utc_h: float = 0.0  # UTC hour at t=0
    day_s: float = 86_400.0  # simulated seconds per day (< 86400: a compressed day)
    blocks: Blocks | None = None  # per request: its prompt's block keys (prefix traces)

    def __len__(self) -> int:
        return len(self.t)


def azure_trace(kind: str, directory: Path = AZURE_DIR) -> Lengths:
    """``kind`` is ``code`` or ``conv``; timestamps become seconds from the first request."""
    path = directory / f"AzureLLMInferenceTrace_{kind}.csv"
    try:
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
        # Seven fractional digits: Python parses at most six.
        stamps = [dt.datetime.fromisoformat(r["TIMESTAMP"][:26]).timestamp() for r in rows]
        prompt = np.array([int(r["ContextTokens"]) for r in rows], dtype=np.int64)
        output = np.array([int(r["GeneratedTokens"]) for r in rows], dtype=np.int64)
    except (OSError, KeyError, ValueError) as e:
        raise SimError(f"cannot read Azure trace {path}: {e}") from e
    t = np.asarray(stamps, dtype=np.float64)
    order = np.argsort(t, kind="stable")
    return Lengths(t[order] - t[order][0], _clip_prompt(prompt[order]),
                   np.clip(output[order], 1, MAX_OUTPUT), f"azure-{kind}")  # fmt: skip


def mooncake_trace(path: Path = MOONCAKE_TRACE, block_tokens: int = 512) -> Lengths:
    """A JSONL trace of ``{"timestamp": ms, "input_length", "output_length", "hash_ids"}`` (one
    key per ``block_tokens`` of the prompt). Prompts are not clipped: the keys would lie."""
    t, prompt, output, blocks = [], [], [], []
    try:
        with path.open() as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    ms, p, o, keys = (row["timestamp"], row["input_length"],
                                      row["output_length"], row["hash_ids"])  # fmt: skip
                    ok = (all(isinstance(x, int) and not isinstance(x, bool) for x in (p, o))
                          and isinstance(ms, int | float) and isinstance(keys, list)
                          and all(isinstance(k, int) for k in keys))  # fmt: skip
                except (ValueError, KeyError, TypeError) as e:
                    raise SimError(f"{path}:{n}: not a trace record ({e})") from e
                if not ok or p < 1 or o < 0 or ms < 0 or len(keys) != -(-p // block_tokens):
                    raise SimError(
                        f"{path}:{n}: need timestamp >= 0, input_length >= 1, output_length >= "
                        f"0 and one hash id per {block_tokens} prompt tokens"
                    )
                t.append(ms / 1000.0)
                prompt.append(p)
                output.append(o)
                blocks.append(tuple(keys))
    except OSError as e:
        raise SimError(f"cannot read trace {path}: {e}") from e
    if not t:
        raise SimError(f"{path}: no requests")
    ts = np.asarray(t, dtype=np.float64)
    order = np.argsort(ts, kind="stable")
    return Lengths(ts[order] - ts[order][0], np.asarray(prompt, dtype=np.int64)[order],
                   np.clip(np.asarray(output, dtype=np.int64)[order], 1, MAX_OUTPUT),
                   path.stem, tuple(blocks[i] for i in order.tolist()))  # fmt: skip


def compress(lengths: Lengths, factor: float, duration_s: float) -> Lengths:
    """``factor`` x the trace's rate by dividing its times (every request once, in order, so
    shared prefixes stay what they were); arrivals from ``duration_s`` on are cut."""
    if factor <= 0 or duration_s <= 0:
        raise SimError(f"cannot compress {lengths.name} by {factor} over {duration_s}s")
    t = lengths.t / factor
    keep = t < duration_s
    blocks = None
    if lengths.blocks is not None:
        blocks = tuple(b for b, k in zip(lengths.blocks, keep.tolist()) if k)
    return Lengths(t[keep], lengths.prompt[keep], lengths.output[keep],
                   f"{lengths.name}x{factor:g}", blocks)  # fmt: skip


def _clip_prompt(p: IntArray) -> IntArray:
    return np.clip(p, 1, MAX_PROMPT)


SYNTHETIC_MIXES: dict[str, tuple[float, float, float, float]] = {
    # name: (prompt median, prompt sigma, output median, output sigma) of log-normals.
    "chat": (300.0, 0.8, 150.0, 0.8),  # short turns, many of them: decode-heavy
    "rag": (4000.0, 0.5, 150.0, 0.7),  # retrieved documents in the prompt: prefill-heavy
}


def synthetic(
    mix: str, rate: float, duration_s: float, seed: int, rag_share: float = 0.0
) -> Lengths:
    """Poisson arrivals at ``rate``/s; ``rag_share`` of them draw RAG lengths, the rest
    ``mix``'s (so ``chat`` with ``rag_share`` 0..1 moves from chat to long-context RAG)."""
    if mix not in SYNTHETIC_MIXES or rate <= 0 or duration_s <= 0 or not 0 <= rag_share <= 1:
        raise SimError(f"bad synthetic mix {mix!r} rate {rate} duration {duration_s}")
    rng = np.random.default_rng(seed)
    n = int(rng.poisson(rate * duration_s))
    t = np.sort(rng.uniform(0.0, duration_s, n))
    rag = rng.random(n) < rag_share
    prompt, output = np.empty(n, np.int64), np.empty(n, np.int64)
    for name, mask in ((mix, ~rag), ("rag", rag)):
        pm, ps, om, os_ = SYNTHETIC_MIXES[name]
        k = int(mask.sum())
        prompt[mask] = np.rint(rng.lognormal(math.log(pm), ps, k))
        output[mask] = np.rint(rng.lognormal(math.log(om), os_, k))
    label = mix if rag_share == 0 else f"{mix}+{rag_share:.0%}rag"
    return Lengths(t, _clip_prompt(prompt), np.clip(output, 1, MAX_OUTPUT), label)


def scale(lengths: Lengths, factor: float, duration_s: float, seed: int) -> Lengths:
    """``factor`` x the trace's rate over ``duration_s``: ceil(factor) copies shifted by random
    offsets (modulo the trace length, so the tiling has no seam), thinned to ``factor``."""
    if factor <= 0 or duration_s <= 0 or len(lengths.t) < 2:
        raise SimError(f"cannot scale {lengths.name} by {factor} over {duration_s}s")
    rng = np.random.default_rng(seed)
    period = lengths.duration_s
    copies = math.ceil(factor)  # each copy brings the trace's own rate
    ts, idx = [], []
    for _ in range(copies):
        shifted = (lengths.t + rng.uniform(0, period)) % period
        for lap in range(math.ceil(duration_s / period)):
            t = shifted + lap * period
            keep = (t < duration_s) & (rng.random(len(t)) < factor / copies)
            ts.append(t[keep])
            idx.append(np.flatnonzero(keep))
    t, i = np.concatenate(ts), np.concatenate(idx)
    order = np.argsort(t, kind="stable")
    return Lengths(t[order], lengths.prompt[i[order]], lengths.output[i[order]],
                   f"{lengths.name}x{factor:g}")  # fmt: skip


def diurnal(local_hour: FloatArray) -> FloatArray:
    """Relative demand by local hour: peak mid-afternoon, a quarter of it at 2 am."""
    return 0.25 + 0.75 * (1 + np.cos(2 * np.pi * (local_hour - 14.0) / 24.0)) / 2


def spread(
    lengths: Lengths,
    regions: Mapping[str, float],
    seed: int,
    hotspot: tuple[str, float] | None = None,
    start_utc_h: float = 12.0,
    day_s: float = 86_400.0,
    thin: bool = True,
) -> Workload:
    """Place requests: region by share x its local diurnal demand at the arrival time, then a
    metro of the region by weight, jittered ~100 km. ``hotspot`` (metro, share) sends that share
    of all requests to one metro on top (a launch, an event, a regional outage elsewhere). With
    ``thin`` the total is thinned by the mean diurnal demand, so traffic follows the sun. With
    block keys, requests sharing a first block take the place of the first of them."""
    names = [r for r, w in regions.items() if w > 0]
    metros = {r: [m for m in METROS if m.region == r] for r in names}
    if not names or any(not metros[r] for r in names):
        raise SimError(f"unknown or empty regions in {dict(regions)}")
    rng = np.random.default_rng(seed)
    hour = start_utc_h + lengths.t / day_s * 24.0
    offsets = np.array([np.mean([m.utc_offset_h for m in metros[r]]) for r in names])
    demand = np.array([regions[r] for r in names]) * diurnal((hour[:, None] + offsets) % 24.0)
    total = demand.sum(axis=1)
    keep = rng.random(len(total)) < total / max(sum(regions[r] for r in names), 1e-12)
    if not thin:
        keep[:] = True
    demand, n = demand[keep], int(keep.sum())
    cum = np.cumsum(demand / demand.sum(axis=1, keepdims=True), axis=1)
    pick = np.minimum((rng.random(n)[:, None] > cum).sum(axis=1), len(names) - 1)
    lat, lon, region = np.empty(n), np.empty(n), np.empty(n, dtype=object)
    for k, r in enumerate(names):
        mask = pick == k
        ms = metros[r]
        w = np.array([m.weight for m in ms])
        which = rng.choice(len(ms), int(mask.sum()), p=w / w.sum())
        lat[mask] = np.array([m.lat for m in ms])[which]
        lon[mask] = np.array([m.lon for m in ms])[which]
        region[mask] = r
    jitter = 1.0
    if hotspot is not None:
        metro = next((m for m in METROS if m.name == hotspot[0]), None)
        if metro is None or not 0 <= hotspot[1] < 1:
            raise SimError(f"bad hot-spot {hotspot}")
        hot = rng.random(n) < hotspot[1]
        lat[hot], lon[hot], region[hot] = metro.lat, metro.lon, metro.region
    lat = np.clip(lat + rng.normal(0, jitter, n), -89.0, 89.0)
    lon = (lon + rng.normal(0, jitter, n) + 180) % 360 - 180
    blocks = None
    if lengths.blocks is not None:
        blocks = tuple(b for b, k in zip(lengths.blocks, keep.tolist()) if k)
        roots = np.array([b[0] if b else -1 - i for i, b in enumerate(blocks)], dtype=np.int64)
        _, first, inverse = np.unique(roots, return_index=True, return_inverse=True)
        src = first[inverse.reshape(-1)]
        lat, lon, region = lat[src], lon[src], region[src]
    return Workload(lengths.t[keep], lengths.prompt[keep], lengths.output[keep], lat, lon,
                    list(region), lengths.name, max(lengths.duration_s, 1e-9), start_utc_h,
                    day_s, blocks)  # fmt: skip
