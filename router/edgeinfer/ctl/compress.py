"""``edgectl compress`` / ``edgectl decompress``: lossless bf16/fp16 checkpoint compression."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn
from rich.table import Table

CLASSES = ("attention", "mlp", "embedding", "norm", "other")
_DIR = click.Path(exists=True, file_okay=False, path_type=Path)


@contextmanager
def _progress_bar(total: int, label: str) -> Iterator[Callable[[str, int], None]]:
    """A byte-counting progress bar on stderr; silent when stderr is not a terminal."""
    console = Console(stderr=True)
    columns = ("{task.description}", BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with Progress(
        *columns, console=console, transient=True, disable=not console.is_terminal
    ) as bar:
        task = bar.add_task(label, total=total)
        yield lambda name, nbytes: bar.update(task, advance=nbytes, description=f"{label} {name}")


def _input_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*.safetensors") if p.is_file())


def summary_table(reports: list[Any]) -> Table:
    """Bytes before/after per tensor class, with a total row; ``reports`` are TensorReports."""
    before: dict[str, int] = defaultdict(int)
    after: dict[str, int] = defaultdict(int)
    count: dict[str, int] = defaultdict(int)
    for report in reports:
        before[report.tensor_class] += report.bytes_before
        after[report.tensor_class] += report.bytes_after
        count[report.tensor_class] += 1
    table = Table()
    for header in ("class", "tensors", "before", "after", "ratio"):
        table.add_column(header, justify="left" if header == "class" else "right")
    rows = [(c, count[c], before[c], after[c]) for c in CLASSES if count[c]]
    rows.append(("total", sum(count.values()), sum(before.values()), sum(after.values())))
    for label, n, b, a in rows:
        ratio = f"{a / b:.1%}" if b else "-"
        table.add_row(label, str(n), f"{b:,}", f"{a:,}", ratio, end_section=label == rows[-2][0])
    return table


@click.command()
@click.argument("in_dir", type=_DIR)
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--chunk", default=None, type=click.IntRange(min=1), help="Symbols per chunk.")
def compress(in_dir: Path, out_dir: Path, chunk: int | None) -> None:
    """Compress every bf16/fp16 tensor of the safetensors files in IN_DIR into OUT_DIR."""
    from edgeinfer.kernels.compression.checkpoint import compress_dir
    from edgeinfer.kernels.compression.format import DEFAULT_CHUNK

    with _progress_bar(_input_bytes(in_dir), "compressing") as advance:
        reports = compress_dir(in_dir, out_dir, advance, chunk or DEFAULT_CHUNK)
    click.echo(f"compressed {in_dir} into {out_dir}")
    Console().print(summary_table(reports))


@click.command()
@click.argument("in_dir", type=_DIR)
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
def decompress(in_dir: Path, out_dir: Path) -> None:
    """Restore the original tensors of a compressed checkpoint IN_DIR into OUT_DIR."""
    from edgeinfer.kernels.compression.checkpoint import decompress_dir

    with _progress_bar(_input_bytes(in_dir), "decompressing") as advance:
        reports = decompress_dir(in_dir, out_dir, advance)
    click.echo(f"decompressed {in_dir} into {out_dir}")
    Console().print(summary_table(reports))
