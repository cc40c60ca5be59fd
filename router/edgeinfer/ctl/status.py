"""``edgectl status``: every PoP and daemon a router knows, as one table.

The table is built from the router's ``GET /admin/pops`` JSON only, so it shows what that
router believes (the state placement decisions are made from), not what each daemon says.
``--format csv|json`` gives the same, one row per daemon (:func:`status_rows`).
"""

from __future__ import annotations

from typing import Any

import click
from rich import box
from rich.table import Table

from edgeinfer.ctl.client import AdminClient, router_options
from edgeinfer.ctl.output import Format, emit, format_option

COLUMNS = (
    "PoP", "daemon", "role", "load", "KV free", "TTFT p50", "prefix hits", "state",
    "heartbeat age",
)  # fmt: skip
_NONE = "-"


def status_table(body: dict[str, Any]) -> Table:
    """The table for one ``/admin/pops`` answer; the router's own PoP is marked with ``*``."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for header in COLUMNS:
        numeric = header in ("load", "KV free", "TTFT p50", "prefix hits", "heartbeat age")
        table.add_column(header, justify="right" if numeric else "left")
    here = body.get("here")
    for pop in body.get("pops", []):
        label = pop["name"] + (" *" if pop["name"] == here else "")
        daemons = pop.get("daemons", [])
        if not daemons:
            table.add_row(label, *[_NONE] * 6, _pop_state(pop), _NONE)
        for i, d in enumerate(daemons):
            table.add_row(
                label if i == 0 else "",
                d["url"],
                d.get("role") or _NONE,
                _load(d),
                _percent(d.get("kv_free")),
                _ms(d.get("ttft_p50_ms")),
                _prefix(d),
                _daemon_state(pop, d),
                _age(d.get("heartbeat_age_s")),
                # A gap closes a PoP of several daemons; single-daemon PoPs stay one per line.
                end_section=len(daemons) > 1 and i == len(daemons) - 1,
            )
    return table


def status_rows(body: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per daemon, ``url`` naming it (a PoP without any: one row, its daemon fields
    empty)."""
    here = body.get("here")
    rows = []
    for pop in body.get("pops", []):
        head = {"pop": pop["name"], "here": pop["name"] == here}
        for d in pop.get("daemons", []) or [{}]:
            rows.append(
                head
                | {key: d.get(key) for key in ("url", "role", "running", "waiting", "kv_free")}
                | {
                    "ttft_p50_ms": d.get("ttft_p50_ms"),
                    "hit_blocks": d.get("hit_blocks"),
                    "cached_blocks": d.get("cached_blocks"),
                    "state": _daemon_state(pop, d) if d else _pop_state(pop),
                    "heartbeat_age_s": d.get("heartbeat_age_s"),
                }
            )
    return rows


def _pop_state(pop: dict[str, Any]) -> str:
    return "draining" if pop.get("draining") else "up"


def _daemon_state(pop: dict[str, Any], d: dict[str, Any]) -> str:
    # A drained PoP drains all its daemons: show that rather than each daemon's own "up".
    state = str(d.get("state") or _NONE)
    if pop.get("draining") and state == "up":
        return "draining"
    return state


def _load(d: dict[str, Any]) -> str:
    running, waiting = d.get("running"), d.get("waiting")
    if running is None:
        return _NONE
    return f"{running} run / {waiting or 0} wait"


def _prefix(d: dict[str, Any]) -> str:
    """Blocks this router's placements found cached there, of the blocks its index holds."""
    hit, cached = d.get("hit_blocks"), d.get("cached_blocks")
    if hit is None or cached is None:
        return _NONE
    return f"{hit} / {cached} blocks"


def _percent(fraction: float | None) -> str:
    return _NONE if fraction is None else f"{fraction:.0%}"


def _ms(value: float | None) -> str:
    return _NONE if value is None else f"{value:.0f} ms"


def _age(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds:.1f}s"


@click.command()
@router_options
@format_option
def status(router_url: str, token: str | None, output_format: Format) -> None:
    """Show every PoP and daemon the router knows, with load and health."""
    body = AdminClient(router_url, token).pops()
    emit(output_format, status_rows(body), lambda: status_table(body))
