"""PNG figures of simulation results (matplotlib, headless). Each function writes one file.

matplotlib comes with the ``edgeinfer[sim]`` extra; without it, importing this module raises a
:class:`~edgeinfer.sim.SimError` that says so (commands import it only to draw).

No map tiles or coastlines ship with the repo, so the world map is an equirectangular plot
whose "continents" are the clients themselves (a density of where requests came from), with
PoPs on top sized by the requests they served and coloured by their decode utilisation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from edgeinfer.sim import SimError

try:
    import matplotlib
except ModuleNotFoundError as exc:
    raise SimError(
        "figures need matplotlib, which comes with the sim extra: pip install 'edgeinfer[sim]'"
    ) from exc

matplotlib.use("Agg")  # files only: no display on servers and CI

import matplotlib.pyplot as plt
import numpy as np

from edgeinfer.sim.metrics import Slo, cdf, latencies, pop_utilisation
from edgeinfer.sim.planner import Plan
from edgeinfer.sim.simulator import SimResult


def _save(fig: plt.Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def world_map(res: SimResult, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(12, 6))
    w = res.workload
    ax.hexbin(w.lon, w.lat, gridsize=(90, 30), extent=(-180, 180, -60, 75), bins="log",
              cmap="Greys", mincnt=1, alpha=0.6)  # fmt: skip
    util = pop_utilisation(res)
    pops = res.topology.pops
    got = np.array([res.received.get(p.name, 0) for p in pops], dtype=float)
    dec = np.array([util[p.name]["decode"] or 0.0 for p in pops])
    sc = ax.scatter([p.lon for p in pops], [p.lat for p in pops], s=20 + 400 * got / max(got.max(), 1),
                    c=dec, cmap="plasma", vmin=0, vmax=1, edgecolors="k", linewidths=0.4)  # fmt: skip
    fig.colorbar(sc, ax=ax, shrink=0.7, label="decode utilisation (busy fraction)")
    ax.set(xlim=(-180, 180), ylim=(-60, 75), xlabel="longitude", ylabel="latitude",
           title=f"{res.policy} on {w.name}: PoPs sized by requests served, grey = clients")  # fmt: skip
    ax.grid(alpha=0.3)
    return _save(fig, path)


def ttft_cdfs(results: Mapping[str, SimResult], slo: Slo, path: Path, title: str = "") -> Path:
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, res in results.items():
        x, y = cdf(latencies(res)[0], 400)
        ax.step(x, y, where="post", label=name)
    ax.axvline(slo.ttft_s, color="k", ls="--", lw=1, label=f"SLO {slo.ttft_s:g} s")
    ax.set(xscale="log", xlabel="TTFT (s, client side)", ylabel="fraction of requests",
           ylim=(0, 1.01), title=title or "TTFT by policy (unfinished requests never reach 1)")  # fmt: skip
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    return _save(fig, path)


def utilisation_over_day(res: SimResult, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(9, 4.5))
    w = res.workload
    per_bucket = res.config.bucket_s / w.day_s * 24.0
    styles = {"prefill": ":", "decode": "-", "both": "--"}
    for group, series in sorted(res.timeline.items()):
        if any(series):
            hours = (w.start_utc_h + (np.arange(len(series)) + 0.5) * per_bucket) % 24.0
            order = np.argsort(hours)  # a day that starts mid-day wraps around midnight
            role = group.split()[0]
            ax.plot(hours[order], np.asarray(series)[order], styles.get(role, "-"),
                    label=f"{group} GPUs")  # fmt: skip
    ax.set(xlabel="hour of the simulated day (UTC)", ylabel="busy fraction", ylim=(0, 1.02),
           title=f"utilisation over the day: {res.policy} on {res.workload.name}")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    return _save(fig, path)


def goodput_bars(table: Mapping[str, Mapping[str, float]], path: Path, title: str) -> Path:
    """``table``: workload -> policy -> goodput (requests/s within SLO)."""
    fig, ax = plt.subplots(figsize=(9, 4.5))
    workloads = list(table)
    policies = list(next(iter(table.values())))
    width = 0.8 / len(policies)
    for i, pol in enumerate(policies):
        xs = np.arange(len(workloads)) + i * width
        ax.bar(xs, [table[w][pol] for w in workloads], width, label=pol)
    ax.set_xticks(np.arange(len(workloads)) + 0.4 - width / 2, workloads)
    ax.set(ylabel="goodput (requests/s within SLO)", title=title)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plan_shift(plans: Sequence[tuple[float, Plan]], path: Path) -> Path:
    """Recommended prefill share of each group's GPUs as the mix moves from chat to RAG."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    groups = sorted(plans[0][1].by_group)
    for g in groups:
        shares = []
        for _, p in plans:
            label = p.by_group[g]
            n = [int("".join(ch for ch in part if ch.isdigit())) for part in label.split(":")]
            shares.append(n[0] / sum(n) if "B" not in label else float("nan"))  # colocated
        ax.plot([f for f, _ in plans], shares, marker="o", label=g)
    ax.set(xlabel="share of requests that are long-context RAG (rest: chat)",
           ylabel="recommended prefill share (gap: colocated)", ylim=(-0.02, 1.02),
           title=f"prefill:decode split recommended by edgectl plan ({plans[0][1].gpus_per_pop} GPUs/PoP)")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)
