"""The serving benchmark's figures: per-run summaries, repeats combined, ratios, tables, JSON."""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from rich.console import Console
from rich.table import Table

from serving_client import Result
from serving_setups import SETUPS, VLLM_SETUPS
from serving_workloads import WORKLOADS, Workload

ITL_TARGET_RATIO = 2.0  # the target: pd's ITL p99 at least 2x lower than both's
KEY_FIGURES = ("output_tok_s", "ttft_p50_s", "itl_p99_s", "e2e_p50_s", "goodput_req_s")

# Wide enough for the results table when the output goes to a log file.
console = Console(width=150)


def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(workload: Workload, results: list[Result], lag: float) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    duration = max(r.end for r in ok) - min(r.start for r in results) if ok else float("nan")
    ttft = [r.ttft_s for r in ok]
    e2e = [r.e2e_s for r in ok]
    itl = [g for r in ok for g in r.itl_s]
    good = [
        r
        for r in ok
        if r.ttft_s <= workload.slo_ttft_s
        and (len(r.itl_s) == 0 or float(np.percentile(r.itl_s, 99)) <= workload.slo_itl_s)
    ]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "output_tokens": out_tokens,
        "req_s": len(ok) / duration,
        "output_tok_s": out_tokens / duration,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "itl_p50_s": pct(itl, 50),
        "itl_p99_s": pct(itl, 99),
        # The longest stall: a p99 misses prefill stalls when they are under 1% of all gaps.
        "itl_max_s": max(itl, default=None),
        "e2e_p50_s": pct(e2e, 50),
        "e2e_p99_s": pct(e2e, 99),
        "slo": {"ttft_s": workload.slo_ttft_s, "itl_p99_s": workload.slo_itl_s},
        "goodput_req_s": len(good) / duration,
        "slo_attainment": len(good) / len(results),
        "max_send_lag_s": lag,
    }


def load_results(path: Path) -> dict[str, Any]:
    return orjson.loads(path.read_bytes()) if path.exists() else {"meta": {}, "runs": {}}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def comparisons(runs: dict[str, Any]) -> dict[str, Any]:
    """Ratios between setups on the same workload: >1 means the second-named setup is better
    for latencies (``x_over_y`` = x's latency / y's) and the first-named for throughputs."""
    out: dict[str, Any] = {}
    for wl in WORKLOADS:
        b, pd = runs.get(f"{wl}/both"), runs.get(f"{wl}/pd")
        if b and pd:
            out[f"{wl}/both_vs_pd"] = {
                "itl_p99_both_over_pd": ratio(b["itl_p99_s"], pd["itl_p99_s"]),
                "itl_max_both_over_pd": ratio(b.get("itl_max_s"), pd.get("itl_max_s")),
                "ttft_p50_both_over_pd": ratio(b["ttft_p50_s"], pd["ttft_p50_s"]),
                "e2e_p50_both_over_pd": ratio(b["e2e_p50_s"], pd["e2e_p50_s"]),
                "output_tok_s_pd_over_both": ratio(pd["output_tok_s"], b["output_tok_s"]),
                "goodput_pd_over_both": ratio(pd["goodput_req_s"], b["goodput_req_s"]),
            }
            itl = out[f"{wl}/both_vs_pd"]["itl_p99_both_over_pd"]
            out[f"{wl}/both_vs_pd"]["itl_target_met"] = itl is not None and itl >= ITL_TARGET_RATIO
        # The anchor is the stronger vLLM on this workload: its default binding or all cores.
        vllms = [(s, r) for s in VLLM_SETUPS if (r := runs.get(f"{wl}/{s}"))]
        if b and vllms:
            name, vl = max(vllms, key=lambda sr: sr[1]["output_tok_s"])
            out[f"{wl}/both_vs_vllm"] = {
                "vllm_binding": name,
                "output_tok_s_edgeinfer_over_vllm": ratio(b["output_tok_s"], vl["output_tok_s"]),
                "ttft_p50_vllm_over_edgeinfer": ratio(vl["ttft_p50_s"], b["ttft_p50_s"]),
                "itl_p50_vllm_over_edgeinfer": ratio(vl["itl_p50_s"], b["itl_p50_s"]),
                "itl_p99_vllm_over_edgeinfer": ratio(vl["itl_p99_s"], b["itl_p99_s"]),
            }
    return out


def fmt(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def print_tables(runs: dict[str, Any], comps: dict[str, Any]) -> None:
    table = Table(title="Serving: client-side latencies (TTFT, E2E in s; ITL in ms)")
    for col in ("workload", "setup", "ok/n", "req/s", "out tok/s", "TTFT p50", "TTFT p99",
                "ITL p50", "ITL p99", "ITL max", "E2E p50", "E2E p99", "goodput", "SLO %"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("workload", "setup") else "right")
    for key, r in runs.items():
        wl, setup = key.split("/")
        table.add_row(
            wl, setup, f"{r['requests'] - r['failed']:.0f}/{r['requests']:.0f}",
            fmt(r["req_s"], digits=3), fmt(r["output_tok_s"], digits=1),
            fmt(r["ttft_p50_s"]), fmt(r["ttft_p99_s"]),
            fmt(r["itl_p50_s"], 1e3, 0), fmt(r["itl_p99_s"], 1e3, 0),
            fmt(r.get("itl_max_s"), 1e3, 0),
            fmt(r["e2e_p50_s"]), fmt(r["e2e_p99_s"]),
            fmt(r["goodput_req_s"], digits=3), fmt(r["slo_attainment"], 100, 0),
        )  # fmt: skip
    console.print(table)
    if comps:
        ct = Table(title="Ratios (latency: x_over_y > 1 means y is faster)")
        ct.add_column("comparison")
        ct.add_column("ratios")
        for key, vals in comps.items():
            ct.add_row(
                key,
                "  ".join(
                    f"{k}={v if isinstance(v, (bool, str)) else fmt(v)}" for k, v in vals.items()
                ),
            )
        console.print(ct)


def combine(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's figures from its repeats: the median of each number (a shared machine
    perturbs single runs), the worst failure count, and the key figures of every repeat."""
    out = dict(reps[0])
    for key, value in reps[0].items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            values = [r[key] for r in reps if r[key] is not None]
            out[key] = statistics.median(values) if values else None
    out["failed"] = max(r["failed"] for r in reps)
    out["errors"] = sorted({e for r in reps for e in r["errors"]})[:5]
    out["repeats"] = [{k: r[k] for k in KEY_FIGURES} for r in reps]
    return out


def save(
    out_path: Path, stored: dict[str, Any], meta: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Write the runs (sorted), their comparisons and this invocation's metadata."""
    runs = dict(sorted(stored["runs"].items(), key=lambda kv: (
        WORKLOADS.index(kv[1]["workload"]), SETUPS.index(kv[1]["setup"]))))  # fmt: skip
    comps = comparisons(runs)
    doc = {
        "meta": {**stored["meta"], "last_run": {**meta, "loadavg_end": os.getloadavg()}},
        "runs": runs,
        "comparisons": comps,
    }
    out_path.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n")
    return runs, comps
