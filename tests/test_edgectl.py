"""``edgectl status/drain/undrain`` against a running router, through click's CliRunner.

edgectl blocks on HTTP, so each invocation runs in a thread while the router (and its fake
daemons) keep serving on the test's event loop.
"""

from __future__ import annotations

import asyncio
import io
import re
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from click.testing import CliRunner, Result
from rich.console import Console

from edgeinfer.ctl.main import cli
from edgeinfer.ctl.status import status_table
from router_helpers import COMPLETION, TOKEN, Cluster, start_cluster


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
        "PoP daemon role load KV free TTFT p50 state heartbeat age",
        "───",
        f"fra * http://FRA both 0 run / 0 wait 75% 42 ms {fra_state} AGE",
        "",
        "nyc http://NYC both 0 run / 0 wait 75% 42 ms up AGE",
    ]


TABLE = """\
PoP     daemon                  role                load   KV free   TTFT p50   state      heartbeat age
────────────────────────────────────────────────────────────────────────────────────────────────────────
fra *   http://10.1.0.11:8100   decode    3 run / 1 wait       50%      42 ms   up                  1.2s
        http://10.1.0.12:8100   prefill                -       90%          -   down               never
{blank}
nyc     -                       -                      -         -          -   draining               -
"""


def test_status_table_layout() -> None:
    fra = [
        {"url": "http://10.1.0.11:8100", "role": "decode", "running": 3, "waiting": 1,
         "kv_free": 0.5, "ttft_p50_ms": 41.6, "state": "up", "heartbeat_age_s": 1.234},
        {"url": "http://10.1.0.12:8100", "role": "prefill", "running": None, "waiting": None,
         "kv_free": 0.9, "ttft_p50_ms": None, "state": "down", "heartbeat_age_s": None},
    ]  # fmt: skip
    body = {"here": "fra", "pops": [
        {"name": "fra", "draining": False, "daemons": fra},
        {"name": "nyc", "draining": True, "daemons": []},
    ]}  # fmt: skip
    console = Console(width=1000, file=io.StringIO())
    console.print(status_table(body))
    assert console.file.getvalue() == TABLE.format(blank=" " * 104)


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
    await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)  # one stream in flight in fra
    drain = asyncio.create_task(
        edgectl(cluster.url, "drain", "fra", "--wait", "--poll-interval", "0.05")
    )
    await asyncio.sleep(0.5)
    assert not drain.done()  # still waiting for the stream
    cluster.fra.gate.set()
    assert (await asyncio.wait_for(resp.read(), 5)).endswith(b"data: [DONE]\n\n")
    resp.close()
    result = await asyncio.wait_for(drain, 10)
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
