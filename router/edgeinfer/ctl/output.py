"""How edgectl prints results: a table for people, CSV or JSON for scripts (``--format``).

A table written to a pipe or a file (``edgectl sim | tee out.txt``) keeps its full width: rich
would otherwise squeeze it into a guessed 80 columns and cut every header. CSV and JSON carry
the rows with their values unrounded, under the keys the command documents; anything else the
command prints (progress, where files went) then goes to stderr, so stdout parses.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar

import click
from rich.console import Console, RenderableType

Format = Literal["table", "csv", "json"]
F = TypeVar("F", bound=Callable[..., Any])

# Wider than any table: rich then lays a table out at its natural width.
_UNBOUNDED_WIDTH = 10_000


def format_option(func: F) -> F:
    """``--format table|csv|json``, passed to the command as ``output_format``."""
    return click.option(
        "--format",
        "output_format",
        type=click.Choice(["table", "csv", "json"]),
        default="table",
        show_default=True,
        help="table: aligned columns; csv or json: one row per line / a list, for scripts.",
    )(func)


def console(output_format: Format = "table") -> Console:
    """Where a command prints: stdout for a table, stderr when stdout carries CSV or JSON."""
    out = Console(stderr=output_format != "table", soft_wrap=True)
    if not out.is_terminal:
        out.width = _UNBOUNDED_WIDTH
    return out


def emit(
    output_format: Format,
    rows: Sequence[Mapping[str, Any]],
    table: Callable[[], RenderableType],
    document: Any = None,
) -> None:
    """Print ``table()`` (built from the same data), or ``rows`` as CSV, or as JSON: a list of
    the rows, or ``document`` when the command's JSON holds more than its rows."""
    if output_format == "table":
        console().print(table())
    elif output_format == "json":
        doc = [_json_row(r) for r in rows] if document is None else document
        click.echo(json.dumps(doc, indent=1, allow_nan=False))
    else:
        click.echo(to_csv(rows), nl=False)


def to_csv(rows: Sequence[Mapping[str, Any]]) -> str:
    """A header of the first row's keys, then one line per row; None is an empty field."""
    if not rows:
        return ""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: "" if v is None else v for k, v in r.items()} for r in rows)
    return buf.getvalue()


def _json_row(row: Mapping[str, Any]) -> dict[str, Any]:
    # JSON has no NaN or infinity: a value that is not a number is null.
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
