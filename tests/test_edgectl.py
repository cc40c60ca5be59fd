"""``edgectl status/drain/undrain`` against a running router, through click's CliRunner, and
the output formats of ``edgectl status/sim/plan``.

edgectl blocks on HTTP, so each invocation runs in a thread while the router (and its fake
daemons) keep serving on the test's event loop.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import re
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from click.testing import CliRunner, Result
from rich.console import Console

from edgeinfer.ctl.main import cli
from edgeinfer.ctl.output import to_csv
from edgeinfer.ctl.status import status_rows as daemon_rows
from edgeinfer.ctl.status import status_table
from edgeinfer.sim import output as sim_output
from router_helpers import COMPLETION, TOKEN, Cluster, start_cluster

# A hang guard, not a speed assumption: each wait ends at its event, long before this.
PATIENCE_S = 60.0


@pytest_asyncio.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with start_cluster(tmp_path) as c:
        yield c


async def edgectl(router: str, *args: str, token: str | None = TOKEN) -> Result:
    env = {"EDGEINFER_ROUTER": router, "EDGEINFER_ADMIN_TOKEN": token}
    return await asyncio.to_thread(CliRunner().invoke, cli, list(args), env=env)


def rows(c: Cluster, output: str) -> list[str]:
    """Each line with its padding collapsed: column widths follow the ports, which vary."""
    output = output.replace(c.fra.url, "http://FRA").replace(c.nyc.url, "http://NYC")
    lines = [" ".join(line.split()) for line in output.splitlines()]
    return [re.sub(r"^─+$", "───", re.sub(r"\d+\.\ds$", "AGE", line)) for line in lines]


def status_rows(fra_state: str) -> list[str]:
    return [
        "PoP daemon role load KV free TTFT p50 prefix hits state heartbeat age",
        "───",
        f"fra * http://FRA both 0 run / 0 wait 75% 42 ms 0 / 0 blocks {fra_state} AGE",
        "nyc http://NYC both 0 run / 0 wait 75% 42 ms 0 / 0 blocks up AGE",
    ]


TABLE = """\
PoP     daemon                  role                load   KV free   TTFT p50       prefix hits   state      heartbeat age
──────────────────────────────────────────────────────────────────────────────────────────────────────────────────────────
fra *   http://10.1.0.11:8100   decode    3 run / 1 wait       50%      42 ms   12 / 340 blocks   up                  1.2s
        http://10.1.0.12:8100   prefill                -       90%          -                 -   down               never
{blank}
nyc     -                       -                      -         -          -                 -   draining               -
"""


def test_status_table_layout() -> None:
    fra = [
        {"url": "http://10.1.0.11:8100", "role": "decode", "running": 3, "waiting": 1,
         "kv_free": 0.5, "ttft_p50_ms": 41.6, "state": "up", "heartbeat_age_s": 1.234,
         "hit_blocks": 12, "cached_blocks": 340},
        {"url": "http://10.1.0.12:8100", "role": "prefill", "running": None, "waiting": None,
         "kv_free": 0.9, "ttft_p50_ms": None, "state": "down", "heartbeat_age_s": None,
         "hit_blocks": None, "cached_blocks": None},
    ]  # fmt: skip
    body = {"here": "fra", "pops": [
        {"name": "fra", "draining": False, "daemons": fra},
        {"name": "nyc", "draining": True, "daemons": []},
    ]}  # fmt: skip
    out = io.StringIO()
    Console(width=1000, file=out).print(status_table(body))
    assert out.getvalue() == TABLE.format(blank=" " * 122)
    assert to_csv(daemon_rows(body)) == STATUS_CSV


STATUS_CSV = """\
pop,here,url,role,running,waiting,kv_free,ttft_p50_ms,hit_blocks,cached_blocks,state,heartbeat_age_s
fra,True,http://10.1.0.11:8100,decode,3,1,0.5,41.6,12,340,up,1.234
fra,True,http://10.1.0.12:8100,prefill,,,0.9,,,,down,
nyc,False,,,,,,,,,draining,
"""


@pytest.mark.asyncio
async def test_status_table(cluster: Cluster) -> None:
    result = await edgectl(cluster.url, "status")
    assert result.exit_code == 0, result.output
    assert rows(cluster, result.output) == status_rows("up")


@pytest.mark.asyncio
async def test_drain_and_undrain(cluster: Cluster) -> None:
    result = await edgectl(cluster.url, "drain", "fra")
    assert (result.exit_code, result.output) == (0, "fra: draining, 0 requests in flight\n")
    status = await edgectl(cluster.url, "status")
    assert rows(cluster, status.output) == status_rows("draining")
    result = await edgectl(cluster.url, "undrain", "fra")
    assert (result.exit_code, result.output) == (0, "fra: accepting requests\n")


@pytest.mark.asyncio
async def test_drain_wait_returns_when_the_last_stream_ends(cluster: Cluster) -> None:
    cluster.fra.gate = asyncio.Event()
    resp = await cluster.post({**COMPLETION, "stream": True})
    await asyncio.wait_for(resp.content.readuntil(b"\n\n"), PATIENCE_S)  # one in flight in fra
    drain = asyncio.create_task(
        edgectl(cluster.url, "drain", "fra", "--wait", "--poll-interval", "0.05")
    )
    await asyncio.sleep(0.5)
    assert not drain.done()  # still waiting for the stream
    cluster.fra.gate.set()
    assert (await asyncio.wait_for(resp.read(), PATIENCE_S)).endswith(b"data: [DONE]\n\n")
    resp.close()
    result = await asyncio.wait_for(drain, PATIENCE_S)
    assert result.exit_code == 0, result.output
    assert result.output == (
        "fra: draining, 1 request in flight\nfra: drained, no requests in flight\n"
    )


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.asyncio
async def test_error_lines(cluster: Cluster) -> None:
    down = f"http://127.0.0.1:{_unused_port()}"
    cases = [
        ((down, "status"), TOKEN, f"error: cannot reach router at {down}: Connection refused"),
        (
            (cluster.url, "drain", "fra"),
            "wrong",
            f"error: router at {cluster.url} refused the admin token (check --token)",
        ),
        (
            (cluster.url, "drain", "xyz"),
            TOKEN,
            "error: unknown PoP 'xyz'; known: fra, nyc (HTTP 404)",
        ),
        (
            (cluster.url, "status"),
            None,
            "error: no admin token: pass --token or set EDGEINFER_ADMIN_TOKEN",
        ),
    ]
    for args, token, line in cases:
        result = await edgectl(*args, token=token)
        assert (result.exit_code, result.output) == (1, line + "\n"), args
    assert not cluster.fra.admin_calls


@pytest.mark.asyncio
async def test_router_options_before_the_command(cluster: Cluster) -> None:
    """``edgectl --router URL drain POP`` as kubectl takes its global flags; the command's own
    flag wins over it, and either wins over the environment."""
    down = f"http://127.0.0.1:{_unused_port()}"
    before = ("--router", cluster.url, "--token", TOKEN)
    result = await edgectl(down, *before, "drain", "fra", token="wrong")
    assert (result.exit_code, result.output) == (0, "fra: draining, 0 requests in flight\n")
    result = await edgectl(down, "--router", down, "undrain", "--router", cluster.url, "fra")
    assert (result.exit_code, result.output) == (0, "fra: accepting requests\n")
    result = await edgectl(cluster.url, "--router", down, "status")
    assert result.output == f"error: cannot reach router at {down}: Connection refused\n"


@pytest.mark.asyncio
async def test_status_csv_and_json(cluster: Cluster) -> None:
    as_csv = await edgectl(cluster.url, "status", "--format", "csv")
    assert as_csv.exit_code == 0, as_csv.output
    table = list(csv.DictReader(io.StringIO(as_csv.stdout)))
    as_json = await edgectl(cluster.url, "status", "--format", "json")
    listed = json.loads(as_json.stdout)
    assert (
        [r["url"] for r in table]
        == [r["url"] for r in listed]
        == [cluster.fra.url, cluster.nyc.url]
    )
    assert [(r["pop"], r["here"], r["state"]) for r in listed] == [
        ("fra", True, "up"),
        ("nyc", False, "up"),
    ]


SUMS = {
    "nearest": {"goodput_rps": 12.0, "slo_attainment": 0.75, "failed": 0, "kv_gb_cross_pop": 0.0,
                "ttft_s": {"p50": 0.25, "p99": float("nan")}, "itl_s": {"p50": 0.008, "p99": 0.02},
                "requests_per_cpu_s": 5000.0},
    "router": {"goodput_rps": 15.0, "slo_attainment": 0.9375, "failed": 2, "kv_gb_cross_pop": 3.5,
               "ttft_s": {"p50": 0.2, "p99": 0.9}, "itl_s": {"p50": 0.007, "p99": 0.0125},
               "requests_per_cpu_s": 2500.0},
}  # fmt: skip
SIM_TABLE = """\
policy    goodput/s   vs nearest   SLO met   TTFT p50   TTFT p99   ITL p50   ITL p99   failed   KV GB x-PoP   req/CPU-s
───────────────────────────────────────────────────────────────────────────────────────────────────────────────────────
nearest        12.0        1.00x     75.0%      250ms          -       8ms      20ms        0             0        5000
router         15.0        1.25x     93.8%      200ms      900ms       7ms      12ms        2             4        2500
"""
SIM_CSV = """\
policy,goodput_rps,vs_nearest,slo_attainment,ttft_p50_s,ttft_p99_s,itl_p50_s,itl_p99_s,failed,kv_gb_cross_pop,requests_per_cpu_s
nearest,12.0,1.0,0.75,0.25,nan,0.008,0.02,0,0.0,5000.0
router,15.0,1.25,0.9375,0.2,0.9,0.007,0.0125,2,3.5,2500.0
"""


def test_sim_table_and_rows_exact() -> None:
    out = io.StringIO()
    Console(width=10_000, file=out).print(sim_output.table(SUMS))
    assert out.getvalue() == SIM_TABLE
    assert to_csv(sim_output.rows(SUMS)) == SIM_CSV


def sim(*args: str) -> Result:
    # A synthetic workload: the Azure traces live beside the repository, not in a clone of it.
    small = ["--workload", "chat", "--duration", "20", "--pops", "3", "--rate", "5",
             "--policy", "nearest"]  # fmt: skip
    return CliRunner().invoke(cli, ["sim", *small, "--policy", "router", *args])


def test_sim_output_is_whole_when_not_a_terminal() -> None:
    """``edgectl sim | tee out.txt``: every header in full, not squeezed to 80 columns."""
    result = sim()
    assert result.exit_code == 0, result.output
    header = next(line for line in result.stdout.splitlines() if line.startswith("policy"))
    assert re.split(r"\s{2,}", header.strip()) == list(sim_output.COLUMNS)
    assert "…" not in result.stdout and len(header) > 80


@pytest.mark.parametrize("output_format", ["csv", "json"])
def test_sim_csv_and_json_on_stdout_only(output_format: str) -> None:
    result = sim("--format", output_format)
    assert result.exit_code == 0, result.output
    parsed: list[dict[str, Any]] = (
        list(csv.DictReader(io.StringIO(result.stdout)))
        if output_format == "csv"
        else json.loads(result.stdout)
    )
    assert [r["policy"] for r in parsed] == ["nearest", "router"]
    assert list(parsed[0]) == SIM_CSV.splitlines()[0].split(",")
    assert "done in" in result.stderr  # progress, kept off the data


def test_sim_and_plan_without_matplotlib(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``pip install edgeinfer`` has no matplotlib (it is the ``sim`` extra): the tables work,
    and asking for figures is one line naming the extra, before any simulation runs."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ModuleNotFoundError
    monkeypatch.delitem(sys.modules, "edgeinfer.sim.plots", raising=False)
    assert sim().exit_code == 0
    plan = ["plan", "--workload", "chat", "--duration", "10", "--pops", "3", "--rate", "5",
            "--gpus", "2"]  # fmt: skip
    assert CliRunner().invoke(cli, plan).exit_code == 0
    line = "Error: figures need matplotlib, which comes with the sim extra: pip install 'edgeinfer[sim]'\n"
    for result in (
        sim("--out", str(tmp_path)),
        CliRunner().invoke(cli, [*plan, "--sweep-rag", "0,1", "--out", str(tmp_path)]),
    ):
        assert (result.exit_code, result.output) == (1, line)
