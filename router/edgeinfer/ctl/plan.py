"""``edgectl plan``: the prefill:decode split per PoP that maximises goodput, by simulation.

Given a workload mix and a GPU budget per PoP, searches splits with the simulator (the router's
own placement on every candidate, see ``edgeinfer.sim.planner``). ``--sweep-rag`` repeats the
plan for mixes moving from chat to long-context RAG and shows how the recommendation moves.
``--format json`` prints what ``--out`` writes to plan.json; ``--format csv`` one row per plan
and group (:func:`plan_rows`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich import box
from rich.console import Group
from rich.table import Table

from edgeinfer.ctl.output import Format, console, emit, format_option
from edgeinfer.ctl.sim import scenario_options, sim_errors

if TYPE_CHECKING:  # the simulator loads numpy (and matplotlib to draw): only when a command runs
    from edgeinfer.sim.planner import Plan
    from edgeinfer.sim.profile import ProfileKind


@click.command()
@scenario_options
@click.option("--gpus", type=click.IntRange(min=1), default=4, show_default=True,
              help="GPU budget of every PoP.")  # fmt: skip
@click.option("--group", type=click.Choice(["region", "metro"]), default="region",
              show_default=True, help="PoPs that share one split.")  # fmt: skip
@click.option("--sweep-rag", default="",
              help="Comma-separated RAG shares (e.g. 0,0.5,1): plan chat+rag:F for each.")  # fmt: skip
@click.option("--out", type=click.Path(path_type=Path),
              help="Write JSON (and, with --sweep-rag, a PNG: edgeinfer[sim] extra) here.")  # fmt: skip
@format_option
@sim_errors
def plan(
    kind: str, rate: float, duration: float, pops: int, regions: str, hotspot: str,
    heartbeat: float, ttft_slo: float, itl_slo: float, profile_kind: ProfileKind, seed: int, gpus: int,
    group: str, sweep_rag: str, out: Path | None, output_format: Format,
) -> None:  # fmt: skip
    """Recommend each PoP's prefill:decode split for a workload and a GPU budget."""
    from edgeinfer.sim import SimError
    from edgeinfer.sim.metrics import Slo
    from edgeinfer.sim.output import check_can_draw
    from edgeinfer.sim.planner import plan as search
    from edgeinfer.sim.profile import EngineProfile
    from edgeinfer.sim.scenario import REGION_MIXES, WorkloadSpec, parse_hotspot
    from edgeinfer.sim.simulator import SimConfig
    from edgeinfer.sim.topology import Split, build_topology

    try:
        shares = [float(x) for x in sweep_rag.split(",")] if sweep_rag else []
    except ValueError as e:
        raise SimError(f"--sweep-rag {sweep_rag!r} is not a list of numbers") from e
    kinds: list[tuple[str, float]] = [(f"chat+rag:{f:g}", f) for f in shares] or [(kind, 0.0)]
    if out is not None and len(kinds) > 1:
        check_can_draw()
    slo, prof = Slo(ttft_slo, itl_slo), EngineProfile.load(kind=profile_kind)
    topo = build_topology(pops, Split(1, gpus - 1) if gpus > 1 else Split(0, 1),
                          list(REGION_MIXES[regions]), seed)  # fmt: skip
    cfg = SimConfig(seed=seed, heartbeat_interval_s=heartbeat)
    progress = console(output_format)
    plans: list[tuple[float, Plan]] = []
    for label, share in kinds:
        work = WorkloadSpec(label, rate, duration, regions, parse_hotspot(hotspot), seed=seed)
        progress.print(f"planning {label}: {pops} PoPs x {gpus} GPUs")
        p = search(topo, work.build(), prof, cfg, slo, gpus, group, progress=None)
        plans.append((share, p))
    doc = [{"rag_share": f, **vars(p)} for f, p in plans]
    emit(output_format, plan_rows(plans), lambda: Group(*(_table(p) for _, p in plans)), doc)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan.json").write_text(json.dumps(doc, indent=1) + "\n")
        if len(plans) > 1:
            from edgeinfer.sim.plots import plan_shift

            plan_shift(plans, out / "plan_shift.png")
        progress.print(f"wrote {out}")


def plan_rows(plans: list[tuple[float, Plan]]) -> list[dict[str, Any]]:
    """One row per plan and group: the split recommended there, with the plan's goodput and
    that of the best split used everywhere (requests/s)."""
    return [
        {
            "workload": p.workload,
            "rag_share": share,
            "group": name,
            "split": split,
            "goodput_rps": p.goodput_rps,
            "best_uniform_rps": p.baseline_rps,
        }
        for share, p in plans
        for name, split in p.by_group.items()
    ]


def _table(p: Plan) -> Table:
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
              title=f"{p.workload}: best uniform {p.baseline_rps:.1f} rps, plan {p.goodput_rps:.1f} "
              f"rps ({p.evaluations} simulations)")  # fmt: skip
    t.add_column("group")
    t.add_column("split")
    for g, s in p.by_group.items():
        t.add_row(g, s)
    t.add_row("", "")
    for label, rps in sorted(p.uniform.items(), key=lambda kv: -kv[1]):
        t.add_row(f"uniform {label}", f"{rps:.1f} rps")
    return t
