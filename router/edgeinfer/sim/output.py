"""What a set of runs leaves behind: a table on the terminal, JSON and PNGs in a folder.

Shared by ``edgectl sim`` and ``bench/sim_report.py`` so the CLI and the report cannot drift.
The JSON holds every number the figures show (CDF points included), so a figure can be redrawn
or checked without rerunning the simulation.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich import box
from rich.table import Table

from edgeinfer.sim.metrics import Slo, cdf, latencies, pop_utilisation, summary
from edgeinfer.sim.plots import ttft_cdfs, utilisation_over_day, world_map
from edgeinfer.sim.simulator import SimResult

COLUMNS = ("policy", "goodput/s", "vs nearest", "SLO met", "TTFT p50", "TTFT p99", "ITL p50",
           "ITL p99", "failed", "KV GB x-PoP", "req/CPU-s")  # fmt: skip


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1000:.0f}ms"


def summaries(results: Mapping[str, SimResult], slo: Slo) -> dict[str, dict[str, Any]]:
    return {name: summary(res, slo) for name, res in results.items()}


def table(sums: Mapping[str, Mapping[str, Any]]) -> Table:
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for c in COLUMNS:
        t.add_column(c, justify="left" if c == "policy" else "right")
    ref = sums.get("nearest", {}).get("goodput_rps")
    for name, s in sums.items():
        ratio = f"{s['goodput_rps'] / ref:.2f}x" if ref else "-"
        t.add_row(
            name, f"{s['goodput_rps']:.1f}", ratio, f"{s['slo_attainment']:.1%}",
            _ms(s["ttft_s"]["p50"]), _ms(s["ttft_s"]["p99"]), _ms(s["itl_s"]["p50"]),
            _ms(s["itl_s"]["p99"]), str(s["failed"]), f"{s['kv_gb_cross_pop']:.0f}",
            f"{s['requests_per_cpu_s']:.0f}",
        )  # fmt: skip
    return t


def write(
    results: Mapping[str, SimResult], slo: Slo, out: Path, stem: str, map_policy: str = "router"
) -> dict[str, Any]:
    """``{stem}.json``, ``{stem}_ttft_cdf.png``, ``{stem}_map.png`` and, when the run spans
    several utilisation buckets, ``{stem}_utilisation.png``."""
    out.mkdir(parents=True, exist_ok=True)
    sums = summaries(results, slo)
    doc: dict[str, Any] = {"slo": {"ttft_s": slo.ttft_s, "itl_s": slo.itl_s}, "policies": {}}
    for name, res in results.items():
        x, y = cdf(latencies(res)[0])
        doc["policies"][name] = sums[name] | {
            "ttft_cdf": {"x": x, "y": y},
            "pop_utilisation": pop_utilisation(res),
            "received": res.received,
            "timeline": res.timeline,
        }
    figures = [ttft_cdfs(results, slo, out / f"{stem}_ttft_cdf.png",
                         f"TTFT by policy: {next(iter(results.values())).workload.name}")]  # fmt: skip
    shown = results.get(map_policy) or next(iter(results.values()))
    figures.append(world_map(shown, out / f"{stem}_map.png"))
    if sum(len(s) > 1 for s in shown.timeline.values()):
        figures.append(utilisation_over_day(shown, out / f"{stem}_utilisation.png"))
    doc["figures"] = [f.name for f in figures]
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=1, default=_jsonable) + "\n")
    return doc


def _jsonable(x: object) -> object:
    if hasattr(x, "tolist"):
        return x.tolist()
    raise TypeError(f"{type(x).__name__} is not JSON serialisable")
