"""The table and notes ``bench/engine.py`` prints, and the targets they are judged by."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

# Targets as engine speed over reference speed (higher is better, so one rule fits all rows).
TARGET_VS_HF_MIXED, TARGET_VS_HF_B1, TARGET_VS_FLOOR = 3.0, 1.0, 0.5


def rows(r: dict) -> list[dict[str, Any]]:
    """Table rows; ``ratio`` is engine speed over reference speed, ``target`` its minimum."""
    m, b = r["mixed"], r["batch1"]
    e_b1 = b["engine_s_per_token"]
    decode_tokens = b["output_tokens"] - 1  # first token to last
    out = [
        {
            "model": r["model"],
            "workload": f"{r['workload']['num_requests']} mixed requests"
            + (" (HF extrapolated)" if m["hf"]["extrapolated"] else ""),
            "ref": "HF",
            "engine_s": m["engine"]["wall_s"],
            "ref_s": m["hf"]["wall_s"],
            "engine_tok_s": m["engine"]["tok_s"],
            "ref_tok_s": m["hf"]["tok_s"],
            "ratio": m["ratio"],
            "target": TARGET_VS_HF_MIXED,
        }
    ]
    decode = decode_tokens * e_b1
    for ref, per_token, target in (
        ("HF", b["hf_s_per_token"], TARGET_VS_HF_B1),
        ("floor", b["floor_s_per_token"], TARGET_VS_FLOOR if r["model"] == "default" else None),
    ):
        out.append(
            {
                "model": r["model"],
                "workload": f"batch 1, {decode_tokens} decode tokens",
                "ref": ref,
                "engine_s": decode,
                "ref_s": decode_tokens * per_token,
                "engine_tok_s": 1 / e_b1,
                "ref_tok_s": 1 / per_token,
                "ratio": per_token / e_b1,
                "target": target,
            }
        )
    for row in out:
        row["pass"] = None if row["target"] is None else row["ratio"] >= row["target"]
    return out


def print_table(console: Console, all_rows: list[dict[str, Any]], meta: dict) -> None:
    table = Table(
        title=f"edgeinfer engine vs transformers ({meta['dtype']}, {meta['threads']} threads)",
        caption="ratio = engine tok/s ÷ reference tok/s; floor = decode weight bytes ÷ "
        f"copy bandwidth ({meta['copy_gbps']:.1f} GB/s read+write)",
    )
    for col in ("model", "workload", "vs", "engine s", "ref s", "engine tok/s", "ref tok/s"):
        table.add_column(col, justify="left" if col in ("model", "workload", "vs") else "right")
    for col in ("ratio", "target", "pass"):
        table.add_column(col, justify="right")
    for row in all_rows:
        verdict = {None: "-", True: "[green]pass[/green]", False: "[red]FAIL[/red]"}[row["pass"]]
        table.add_row(
            row["model"],
            row["workload"],
            row["ref"],
            f"{row['engine_s']:.2f}",
            f"{row['ref_s']:.2f}",
            f"{row['engine_tok_s']:.1f}",
            f"{row['ref_tok_s']:.1f}",
            f"{row['ratio']:.2f}x",
            "-" if row["target"] is None else f">= {row['target']:g}x",
            verdict,
        )
    console.print(table)


def print_notes(console: Console, results: list[dict[str, Any]]) -> None:
    """Per model, what the table leaves out: padding, preemptions, agreement, the run pairs."""
    for r in results:
        b = r["batch1"]
        console.print(
            f"{r['model']}: HF padding waste {r['mixed']['hf']['padding_waste']:.0%}, "
            f"engine preemptions {r['mixed']['engine']['preemptions']}, "
            f"batch-1 greedy tokens agree for {b['greedy_tokens_agree']}/{b['output_tokens']}"
        )
        pairs = ", ".join(f"{x:.2f}x" for x in r["mixed"]["pair_ratios"])
        console.print(f"{r['model']}: mixed runs, engine vs HF one by one: {pairs}")
        if r["mixed"]["hf"]["extrapolated"]:
            h = r["mixed"]["hf"]
            console.print(
                f"[yellow]{r['model']}: HF ran {h['batches_run']} of {h['batches_total']} "
                f"batches ({sum(h['batch_wall_s']):.1f} s); its total is extrapolated[/yellow]"
            )
