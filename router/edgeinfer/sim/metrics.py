"""From simulated requests to what an operator reads: latency, goodput, utilisation, bytes.

TTFT is client-side: request out, first token back (both network legs included). ITL is the
mean gap between a request's tokens at its decode engine (the network adds the same delay to
every token, so gaps are the same at the client). Goodput is requests per second of the arrival
window that finished within both SLOs; failed, rejected and unfinished requests count against
it, which is the point of measuring goodput rather than throughput.

Load balance is max / mean over the decode-capable engines of the requests each decoded and of
the seconds each spent decoding (a request of ten tokens and one of a thousand count alike in
the first, not in the second), and over the prefill-capable ones of the prompt tokens each
computed. On prefix-sharing workloads the block hit rate (blocks a prefill found in its
engine's cache or received from its decode engine / blocks asked; the latter also apart, as
the pulled rate) is reported beside what an infinite cache and one pooled cache of the fleet's
KV would have hit.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

import numpy as np

from edgeinfer.sim.events import DONE, FAILED, REJECTED
from edgeinfer.sim.prefix_cache import BLOCK_TOKENS, hit_rate_bounds
from edgeinfer.sim.simulator import SimResult

PERCENTILES = (50, 90, 99)


@dataclasses.dataclass(frozen=True)
class Slo:
    ttft_s: float = 1.0
    itl_s: float = 0.05


def latencies(res: SimResult) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """TTFT and ITL of every request (NaN where it did not finish), and the done mask."""
    r, w = res.requests, res.workload
    done = r["status"] == DONE
    ttft = np.where(done, r["first"] + r["net"] / 2 - w.t, np.nan)
    gaps = np.maximum(w.output - 1, 1)
    itl = np.where(done, np.where(w.output > 1, (r["last"] - r["first"]) / gaps, 0.0), np.nan)
    return ttft, itl, done


def _pcts(x: np.ndarray) -> dict[str, float]:
    x = x[~np.isnan(x)]
    if not len(x):
        return {f"p{p}": float("nan") for p in PERCENTILES} | {"mean": float("nan")}
    return {f"p{p}": float(np.percentile(x, p)) for p in PERCENTILES} | {"mean": float(x.mean())}


def summary(res: SimResult, slo: Slo) -> dict[str, Any]:
    ttft, itl, done = latencies(res)
    ok = done & (ttft <= slo.ttft_s) & (itl <= slo.itl_s)
    n, span = len(res.workload), res.workload.span_s
    status = res.requests["status"]
    util = pop_utilisation(res)
    stage = {s: float(np.mean([u[s] for u in util.values() if u[s] is not None] or [0.0]))
             for s in ("prefill", "decode")}  # fmt: skip
    return {
        "policy": res.policy,
        "workload": res.workload.name,
        "requests": n,
        "pops": len(res.topology.pops),
        "gpus": res.topology.gpus,
        "span_s": span,
        "offered_rps": n / span,
        "goodput_rps": float(ok.sum()) / span,
        "slo_attainment": float(ok.mean()),
        "slo": dataclasses.asdict(slo),
        "ttft_s": _pcts(ttft),
        "itl_s": _pcts(itl),
        "done": int(done.sum()),
        "failed": int((status == FAILED).sum()),
        "rejected": int((status == REJECTED).sum()),
        "counters": dict(res.counters),
        "kv_gb_cross_pop": res.counters["kv_bytes_cross_pop"] / 1e9,
        "load_max_mean": load_balance(res),
        "prefix": prefix_hits(res),
        "mean_utilisation": stage,
        "sim_s": res.sim_end_s,
        "wall_s": res.wall_s,
        "cpu_s": res.cpu_s,
        "requests_per_cpu_s": n / res.cpu_s if res.cpu_s > 0 else float("inf"),
    }


def _max_mean(x: np.ndarray) -> float | None:
    return float(x.max() / x.mean()) if len(x) and x.mean() > 0 else None


def load_balance(res: SimResult) -> dict[str, float | None]:
    """Max / mean per engine: requests decoded and seconds spent decoding (decode-capable
    engines), prompt tokens computed (prefill-capable engines)."""
    roles = [e["role"] for e in res.engines]
    placed = res.requests["decode"][res.requests["status"] != REJECTED]
    decoded = np.bincount(placed, minlength=len(roles))
    d = np.array([r in ("decode", "both") for r in roles])
    p = np.array([r in ("prefill", "both") for r in roles])
    tokens = np.array([e["prompt_tokens"] for e in res.engines])
    decode_s = np.array([e["decode_s"] for e in res.engines])
    return {
        "decode": _max_mean(decoded[d]),
        "decode_busy": _max_mean(decode_s[d]),
        "prefill": _max_mean(tokens[p]),
    }


def prefix_hits(res: SimResult) -> dict[str, float] | None:
    """Block hit rate and its bounds; None when the workload names no blocks."""
    blocks = res.workload.blocks
    if blocks is None:
        return None
    c = res.counters
    fleet = res.config.kv_tokens_per_gpu // BLOCK_TOKENS * res.topology.gpus
    bounds = hit_rate_bounds(blocks, fleet)
    asked = c["prefix_blocks_asked"]
    return {
        "block_hit_rate": c["prefix_blocks_hit"] / asked if asked else 0.0,
        # Of the hits, blocks the prefill engine received from its decode engine.
        "pulled_block_rate": c["prefix_blocks_pulled"] / asked if asked else 0.0,
        "kv_gb_pulled": c["kv_bytes_pulled"] / 1e9,
        # Blocks some daemon held when the request arrived: the best any placement could hit.
        "fleet_held_rate": c["prefix_blocks_held"] / asked if asked else 0.0,
        "infinite_cache_bound": bounds["infinite"],
        "pooled_cache_bound": bounds["pooled"],
        "blocks_asked": asked,
    }


def pop_utilisation(res: SimResult) -> dict[str, dict[str, float | None]]:
    """Per PoP and stage: busy GPU-seconds of that stage over the GPU-seconds able to do it
    (``both`` engines count towards both stages, each with its own share of the work)."""
    span = max(res.sim_end_s, 1e-9)
    busy: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for e in res.engines:
        b = busy[e["pop"]]
        for stage, busy_s in (("prefill", e["prefill_s"]), ("decode", e["decode_s"])):
            if e["role"] in (stage, "both"):
                b[stage] += busy_s
                b[f"{stage}_gpus"] += 1
    out: dict[str, dict[str, float | None]] = {}
    for pop, b in busy.items():
        gpus = {s: b[f"{s}_gpus"] for s in ("prefill", "decode")}
        out[pop] = {s: b[s] / (g * span) if g else None for s, g in gpus.items()}
    return out


def cdf(x: np.ndarray, points: int = 200) -> tuple[list[float], list[float]]:
    """A CDF thinned to ``points`` steps (for JSON and plots); unfinished requests are the
    part of the curve that never reaches 1."""
    total = len(x)
    x = np.sort(x[~np.isnan(x)])
    if not len(x):
        return [], []
    idx = np.unique(np.linspace(0, len(x) - 1, min(points, len(x))).astype(int))
    return x[idx].tolist(), ((idx + 1) / total).tolist()
