"""What a set of runs leaves behind: a table (or its rows, for CSV and JSON), JSON and PNGs in
a folder.

Shared by ``edgectl sim`` and ``bench/sim_report.py`` so the CLI and the report cannot drift.
The JSON holds every number the figures show (CDF points included), so a figure can be redrawn
or checked without rerunning the simulation. Only :func:`write` draws, so only it needs
matplotlib (the ``edgeinfer[sim]`` extra).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rich import box
from rich.table import Table

from edgeinfer.sim.metrics import Slo, cdf, latencies, pop_utilisation, summary
from edgeinfer.sim.simulator import SimResult


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1000:.0f}ms"


# One per column: its key in CSV and JSON rows, its table header, and how the table shows it.
FIELDS: tuple[tuple[str, str, Callable[[Any], str]], ...] = (
    ("policy", "policy", str),
    ("goodput_rps", "goodput/s", lambda v: f"{v:.1f}"),
    ("vs_nearest", "vs nearest", lambda v: "-" if v is None else f"{v:.2f}x"),
    ("slo_attainment", "SLO met", lambda v: f"{v:.1%}"),
    ("ttft_p50_s", "TTFT p50", _ms),
    ("ttft_p99_s", "TTFT p99", _ms),
    ("itl_p50_s", "ITL p50", _ms),
    ("itl_p99_s", "ITL p99", _ms),
    ("failed", "failed", str),
    ("kv_gb_cross_pop", "KV GB x-PoP", lambda v: f"{v:.0f}"),
    ("requests_per_cpu_s", "req/CPU-s", lambda v: f"{v:.0f}"),
)
COLUMNS = tuple(header for _, header, _ in FIELDS)
# Appended when the workload shares prefixes (``edgectl sim --trace``).
PREFIX_FIELDS: tuple[tuple[str, str, Callable[[Any], str]], ...] = (
    ("ttft_p90_s", "TTFT p90", _ms),
    ("block_hit_rate", "hit rate", lambda v: f"{v:.1%}"),
    ("pulled_block_rate", "pulled", lambda v: f"{v:.1%}"),
    ("pooled_cache_bound", "pooled bound", lambda v: f"{v:.1%}"),
    ("decode_max_mean", "D max/mean", lambda v: "-" if v is None else f"{v:.2f}"),
    ("decode_busy_max_mean", "D busy", lambda v: "-" if v is None else f"{v:.2f}"),
)


def summaries(results: Mapping[str, SimResult], slo: Slo) -> dict[str, dict[str, Any]]:
    return {name: summary(res, slo) for name, res in results.items()}


def rows(sums: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per policy, keyed as :data:`FIELDS`, with unrounded values (seconds, ratios)."""
    ref = sums.get("nearest", {}).get("goodput_rps")
    return [
        {
            "policy": name,
            "goodput_rps": s["goodput_rps"],
            "vs_nearest": s["goodput_rps"] / ref if ref else None,
            "slo_attainment": s["slo_attainment"],
            "ttft_p50_s": s["ttft_s"]["p50"],
            "ttft_p99_s": s["ttft_s"]["p99"],
            "itl_p50_s": s["itl_s"]["p50"],
            "itl_p99_s": s["itl_s"]["p99"],
            "failed": s["failed"],
            "kv_gb_cross_pop": s["kv_gb_cross_pop"],
            "requests_per_cpu_s": s["requests_per_cpu_s"],
        }
        | _prefix_row(s)
        for name, s in sums.items()
    ]


def _prefix_row(s: Mapping[str, Any]) -> dict[str, Any]:
    prefix = s.get("prefix")
    if prefix is None:
        return {}
    return {
        "ttft_p90_s": s["ttft_s"]["p90"],
        "block_hit_rate": prefix["block_hit_rate"],
        "pulled_block_rate": prefix["pulled_block_rate"],
        "pooled_cache_bound": prefix["pooled_cache_bound"],
        "decode_max_mean": s["load_max_mean"]["decode"],
        "decode_busy_max_mean": s["load_max_mean"]["decode_busy"],
    }


def table(sums: Mapping[str, Mapping[str, Any]]) -> Table:
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    all_rows = rows(sums)
    fields = FIELDS + (PREFIX_FIELDS if all_rows and "block_hit_rate" in all_rows[0] else ())
    for key, header, _ in fields:
        t.add_column(header, justify="left" if key == "policy" else "right")
    for row in all_rows:
        t.add_row(*(cell(row[key]) for key, _, cell in fields))
    return t


def check_can_draw() -> None:
    """Raise :class:`~edgeinfer.sim.SimError` now, not after a long run, when the figures
    :func:`write` draws cannot be drawn here (no matplotlib)."""
    import edgeinfer.sim.plots  # noqa: F401


def write(
    results: Mapping[str, SimResult], slo: Slo, out: Path, stem: str, map_policy: str = "router"
) -> dict[str, Any]:
    """``{stem}.json``, ``{stem}_ttft_cdf.png``, ``{stem}_map.png`` and, when the run spans
    several utilisation buckets, ``{stem}_utilisation.png``."""
    from edgeinfer.sim.plots import ttft_cdfs, utilisation_over_day, world_map

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
