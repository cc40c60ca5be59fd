"""Simulation report (not a test): goodput under SLO per placement policy, plus the figures.

1. Policies on the two Azure traces (code, conversation), spread over three continents with a
   regional hot-spot, at equal GPUs per PoP, for the daemons' default heartbeat period and a
   short one (the selector reads load only from heartbeats, so their age matters).
2. Utilisation over a (compressed) day of worldwide chat traffic.
3. ``edgectl plan``'s recommendation as the mix moves from chat to long-context RAG.
4. Scale: 300 PoPs and ~1M requests, CPU seconds of the one simulation process.

Writes ``docs/figures/*.png`` and one ``docs/figures/sim_report_<part>.json`` per part, prints
the tables. Parts are independent, so they can run as separate processes (one core each).

    .venv/bin/python bench/sim_report.py [--quick] [--part policies|day|plan|scale ...]
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # one core means one thread

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from rich.console import Console  # noqa: E402

from edgeinfer.sim.metrics import Slo, summary  # noqa: E402
from edgeinfer.sim.output import summaries, table, write  # noqa: E402
from edgeinfer.sim.planner import plan  # noqa: E402
from edgeinfer.sim.plots import goodput_bars, plan_shift, utilisation_over_day  # noqa: E402
from edgeinfer.sim.profile import EngineProfile  # noqa: E402
from edgeinfer.sim.scenario import POLICIES, REGION_MIXES, WorkloadSpec, run  # noqa: E402
from edgeinfer.sim.simulator import SimConfig  # noqa: E402
from edgeinfer.sim.topology import Split, build_topology  # noqa: E402

FIGURES = Path(__file__).parents[1] / "docs" / "figures"
SLO = Slo(ttft_s=1.0, itl_s=0.05)
HOTSPOT = ("mumbai", 0.3)
# (label, trace, split, x the trace's rate). The code trace twice: at x40 the hot-spot barely
# exceeds its local capacity (nearest still meets the SLO for ~88%), at x80 it clearly does.
TRACES = (
    ("azure-code", "azure-code", Split(2, 2), 40.0),
    ("azure-code-x80", "azure-code", Split(2, 2), 80.0),
    ("azure-conv", "azure-conv", Split(1, 3), 60.0),
)
TARGET_VS_NEAREST, TARGET_VS_BEST = 1.3, 0.98
PLAN_RATE = 250.0  # requests/s on 12 PoPs x 4 GPUs


def policy_tables(args: argparse.Namespace, prof: EngineProfile, console: Console) -> dict:
    out: dict[str, Any] = {}
    regions = list(REGION_MIXES["three-continents"])
    for hb in (5.0, 0.5):
        goodput: dict[str, dict[str, float]] = {}
        for kind, trace, split, rate in TRACES:
            topo = build_topology(args.pops, split, regions, seed=0)
            work = WorkloadSpec(trace, rate, args.duration, hotspot=HOTSPOT).build()
            cfg = SimConfig(heartbeat_interval_s=hb)
            results = {p: run(p, topo, work, prof, cfg, SLO) for p in POLICIES}
            sums = summaries(results, SLO)
            console.print(f"[bold]{trace}[/] x{rate:g}, {split.label()} per PoP, heartbeat {hb:g}s")
            console.print(table(sums))
            stem = f"sim_{kind}_hb{hb:g}"
            write(results, SLO, FIGURES, stem)
            goodput[kind] = {p: s["goodput_rps"] for p, s in sums.items()}
            best = max(v for p, v in goodput[kind].items() if p != "router")
            router = goodput[kind]["router"]
            out[stem] = {
                "split": split.label(), "rate_x": rate, "heartbeat_s": hb,
                "goodput_rps": goodput[kind],
                "router_vs_nearest": router / goodput[kind]["nearest"],
                "router_vs_best_baseline": router / best,
                "meets_targets": router >= TARGET_VS_NEAREST * goodput[kind]["nearest"]
                and router >= TARGET_VS_BEST * best,
            }  # fmt: skip
        goodput_bars(goodput, FIGURES / f"sim_goodput_hb{hb:g}.png",
                     f"goodput within SLO, 3 continents + hot-spot, heartbeat {hb:g}s")  # fmt: skip
    return out


def day(args: argparse.Namespace, prof: EngineProfile) -> dict:
    """24 h of worldwide chat compressed into ``day_s`` simulated seconds (the diurnal curve is
    what moves; engine physics are unchanged)."""
    day_s = 1800.0 if args.quick else 3600.0
    work = WorkloadSpec("chat", 60.0, day_s, "world", None, 0.0, day_s).build()
    topo = build_topology(args.pops, Split(1, 3), seed=0)
    res = run("router", topo, work, prof, SimConfig(bucket_s=day_s / 96), SLO)
    utilisation_over_day(res, FIGURES / "sim_utilisation_day.png")
    return summary(res, SLO) | {"timeline": res.timeline, "day_s": day_s}


def plan_sweep(args: argparse.Namespace, prof: EngineProfile, console: Console) -> list[dict]:
    shares = [0.0, 0.5, 1.0] if args.quick else [0.0, 0.25, 0.5, 0.75, 1.0]
    topo = build_topology(12, Split(1, 3), list(REGION_MIXES["three-continents"]), seed=0)
    plans = []
    for f in shares:
        # Loaded enough that splits differ: below capacity every split meets the SLO.
        work = WorkloadSpec(f"chat+rag:{f:g}", PLAN_RATE, 60.0, hotspot=HOTSPOT).build()
        p = plan(topo, work, prof, SimConfig(heartbeat_interval_s=0.5), SLO, gpus=4)
        console.print(f"RAG share {f:g}: {p.by_group} ({p.goodput_rps:.1f} rps)")
        plans.append((f, p))
    plan_shift(plans, FIGURES / "sim_plan_shift.png")
    return [{"rag_share": f, **vars(p)} for f, p in plans]


def scale(args: argparse.Namespace, prof: EngineProfile) -> dict:
    topo = build_topology(300, Split(1, 3), seed=0)
    work = WorkloadSpec("azure-conv", 300.0, 1000.0, "world", None).build()
    res = run("router", topo, work, prof, SimConfig(), SLO)
    s = summary(res, SLO)
    keys = ("requests", "pops", "gpus", "cpu_s", "wall_s", "requests_per_cpu_s", "goodput_rps")
    return {k: s[k] for k in keys} | {"meets_10_min": s["cpu_s"] < 600}


PARTS = ("policies", "day", "plan", "scale")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs (smoke)")
    parser.add_argument("--part", action="append", choices=PARTS, help="repeatable; default all")
    parser.add_argument("--pops", type=int, default=30)
    parser.add_argument("--pin", type=int, help="CPU to pin to (Linux)")
    args = parser.parse_args()
    args.duration = 60.0 if args.quick else 300.0
    if args.pin is not None:
        os.sched_setaffinity(0, {args.pin})
    console = Console(width=140)
    prof = EngineProfile.load()
    FIGURES.mkdir(parents=True, exist_ok=True)
    for part in args.part or PARTS:
        if part == "policies":
            result: Any = policy_tables(args, prof, console)
        elif part == "day":
            result = day(args, prof)
        elif part == "plan":
            result = plan_sweep(args, prof, console)
        else:
            result = scale(args, prof)
            console.print(f"scale: {result}")
        doc = {"profile": prof.source, "slo": vars(SLO), part: result}
        path = FIGURES / f"sim_report_{part}.json"
        path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
        console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
