"""``edgectl sim``: simulate a deployment of many PoPs under a workload, policy by policy.

Runs on this machine, no router needed: the placement is the router's own selector fed by
simulated heartbeats (see docs/SIMULATION.md). Prints one row per policy (``--format csv`` or
``json`` for scripts: keys as :data:`edgeinfer.sim.output.FIELDS`, times in seconds); with
``--out`` also writes JSON and PNGs (TTFT CDFs, a world map of PoPs, utilisation over time),
for which matplotlib is needed (``pip install 'edgeinfer[sim]'``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from edgeinfer.ctl.output import Format, console, emit, format_option
from edgeinfer.shared.errors import EdgeInferError

if TYPE_CHECKING:  # the simulator loads numpy: only when a command runs
    from edgeinfer.sim.profile import ProfileKind

POLICY_NAMES = ("router", "colocated", "nearest", "least-loaded", "round-robin")
# The default with --trace (edgeinfer.sim.policies.PREFIX_TRACE_POLICIES).
PREFIX_POLICY_NAMES = ("router-prefix-blind", "max-prefix", "session-hash", "prefix-aware")


def scenario_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Workload and world options shared by ``sim`` and ``plan``."""
    options = [
        click.option("--workload", "kind", default="azure-conv", show_default=True,
                     help="azure-code, azure-conv, chat, rag or chat+rag:F (F of requests RAG)."),
        click.option("--rate", type=float, default=40.0, show_default=True,
                     help="Requests/s (synthetic) or x the trace's own rate (azure-*)."),
        click.option("--duration", type=float, default=300.0, show_default=True,
                     help="Seconds of arrivals."),
        click.option("--pops", type=click.IntRange(min=1), default=30, show_default=True),
        click.option("--regions", default="three-continents", show_default=True,
                     help="Client region mix (three-continents or world); PoPs follow it."),
        click.option("--hotspot", default="mumbai:0.3", show_default=True,
                     help="METRO:SHARE of all requests from one metro; '' for none."),
        click.option("--heartbeat", type=float, default=5.0, show_default=True,
                     help="Daemon heartbeat interval (s)."),
        click.option("--ttft-slo", type=float, default=1.0, show_default=True),
        click.option("--itl-slo", type=float, default=0.05, show_default=True),
        click.option("--profile", "profile_kind", type=click.Choice(["gpu_like", "measured"]),
                     default="gpu_like", show_default=True, help="Engine cost profile."),
        click.option("--seed", type=int, default=0, show_default=True),
    ]  # fmt: skip
    for option in reversed(options):
        fn = option(fn)
    return fn


def sim_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Simulation input errors become one-line click errors (exit 1), like other commands'."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except EdgeInferError as e:
            raise click.ClickException(str(e)) from e

    return wrapper


def _outages(specs: tuple[str, ...], kind: str) -> list[Any]:
    """``POP@START[-END]`` -> Outage."""
    from edgeinfer.sim import SimError
    from edgeinfer.sim.events import Outage

    out = []
    for spec in specs:
        pop, _, when = spec.partition("@")
        start, _, end = when.partition("-")
        try:
            out.append(Outage(pop, float(start), float(end) if end else None, kind))
        except ValueError as e:
            raise SimError(f"--{kind} {spec!r} is not like POP@120 or POP@120-300") from e
    return out


@click.command()
@scenario_options
@click.option("--split", default="1P:3D", show_default=True,
              help="GPUs per PoP as prefill:decode[:both], e.g. 1P:3D or 2P:5D:1B.")  # fmt: skip
@click.option("--policy", "policies", multiple=True,
              type=click.Choice(POLICY_NAMES + PREFIX_POLICY_NAMES),
              help="Repeatable; default all but the prefix ones (with --trace: those).")  # fmt: skip
@click.option("--trace", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Mooncake-format JSONL (hash_ids per 512 tokens) instead of --workload; "
                   "--rate compresses its time.")  # fmt: skip
@click.option("--fail", multiple=True, help="POP@START[-END]: power off a PoP (repeatable).")
@click.option("--drain", multiple=True, help="POP@START[-END]: admin-drain a PoP (repeatable).")
@click.option("--out", type=click.Path(path_type=Path),
              help="Write JSON and PNGs here (PNGs need the edgeinfer[sim] extra).")  # fmt: skip
@format_option
@sim_errors
def sim(
    kind: str, rate: float, duration: float, pops: int, regions: str, hotspot: str,
    heartbeat: float, ttft_slo: float, itl_slo: float, profile_kind: ProfileKind, seed: int, split: str,
    policies: tuple[str, ...], trace: Path | None, fail: tuple[str, ...], drain: tuple[str, ...],
    out: Path | None, output_format: Format,
) -> None:  # fmt: skip
    """Simulate PoPs, clients and placement policies; compare goodput under the SLO."""
    from edgeinfer.sim.metrics import Slo
    from edgeinfer.sim.output import check_can_draw, rows, summaries, table, write
    from edgeinfer.sim.profile import EngineProfile
    from edgeinfer.sim.scenario import REGION_MIXES, WorkloadSpec, parse_hotspot, parse_split, run
    from edgeinfer.sim.simulator import SimConfig
    from edgeinfer.sim.topology import build_topology

    if out is not None:
        check_can_draw()
    slo = Slo(ttft_slo, itl_slo)
    prof = EngineProfile.load(kind=profile_kind)
    work = WorkloadSpec(kind, rate, duration, regions, parse_hotspot(hotspot), seed=seed,
                        trace=trace).build()  # fmt: skip
    topo = build_topology(pops, parse_split(split), list(REGION_MIXES[regions]), seed)
    cfg = SimConfig(seed=seed, heartbeat_interval_s=heartbeat,
                    outages=tuple(_outages(fail, "fail") + _outages(drain, "drain")))  # fmt: skip
    progress = console(output_format)
    progress.print(f"{len(work)} requests ({work.name}) over {len(topo.pops)} PoPs, "
                   f"{topo.gpus} GPUs ({split} each), profile {prof.source}")  # fmt: skip
    results = {}
    for name in policies or (PREFIX_POLICY_NAMES if trace else POLICY_NAMES):
        results[name] = run(name, topo, work, prof, cfg, slo)
        progress.print(f"  {name}: done in {results[name].cpu_s:.1f} CPU-s")
    sums = summaries(results, slo)
    emit(output_format, rows(sums), lambda: table(sums))
    if out is not None:
        doc = write(results, slo, out, f"sim_{work.name}")
        progress.print(f"wrote {out}: {', '.join(doc['figures'])} and sim_{work.name}.json")
