"""The router's admin API: bearer token, PoP state, drain/undrain under load, SIGHUP reload."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from edgeinfer.router.app import reload_pops
from router_helpers import (
    COMPLETION,
    MODEL,
    TOKEN,
    Cluster,
    start_cluster,
    wait_placeable,
    write_config,
)

AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest_asyncio.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with start_cluster(tmp_path) as c:
        yield c


async def admin(c: Cluster, method: str, path: str, **kwargs: Any) -> tuple[int, Any]:
    kwargs.setdefault("headers", AUTH)
    async with c.http.request(method, c.url + "/admin" + path, **kwargs) as resp:
        return resp.status, await resp.json()


@pytest.mark.asyncio
async def test_admin_refuses_a_missing_or_wrong_token(cluster: Cluster) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        async with cluster.http.get(cluster.url + "/admin/pops", headers=headers) as resp:
            assert resp.status == 401
            assert resp.headers["WWW-Authenticate"] == "Bearer"
            assert (await resp.json())["error"]["code"] == "invalid_admin_token"
        async with cluster.http.post(cluster.url + "/admin/pops/fra/drain", headers=headers) as r:
            assert r.status == 401
    assert not cluster.fra.admin_calls


@pytest.mark.asyncio
async def test_admin_is_closed_without_a_token_file(tmp_path: Path) -> None:
    async with start_cluster(tmp_path, token=None) as c:
        status, body = await admin(c, "GET", "/pops")
    assert status == 403 and body["error"]["code"] == "admin_disabled"


@pytest.mark.asyncio
async def test_list_pops_reports_daemons_learned_from_themselves(cluster: Cluster) -> None:
    status, body = await admin(cluster, "GET", "/pops")
    assert status == 200 and body["here"] == "fra"
    assert [p["name"] for p in body["pops"]] == ["fra", "nyc"]
    fra = body["pops"][0]
    assert (fra["lat"], fra["draining"], fra["in_flight"]) == (50.11, False, 0)
    (daemon,) = fra["daemons"]
    assert daemon["url"] == cluster.fra.url and daemon["kv_endpoint"] == cluster.fra.kv_endpoint
    assert (daemon["role"], daemon["model"], daemon["state"]) == ("both", MODEL, "up")
    assert (daemon["kv_free"], daemon["ttft_p50_ms"]) == (0.75, 42.0)
    assert daemon["heartbeat_age_s"] >= 0  # and fresh: "up" means within the router's limit


@pytest.mark.asyncio
async def test_unknown_pop_or_daemon_is_404(cluster: Cluster) -> None:
    status, body = await admin(cluster, "POST", "/pops/xyz/drain")
    assert status == 404 and body["error"]["message"] == "unknown PoP 'xyz'; known: fra, nyc"
    status, _ = await admin(cluster, "POST", "/daemons/drain", json={"url": "http://nope:1"})
    assert status == 404


@pytest.mark.asyncio
async def test_drain_under_a_stream_of_requests(cluster: Cluster) -> None:
    cluster.fra.chunk_delay_s = cluster.nyc.chunk_delay_s = 0.02
    cluster.fra.gate = asyncio.Event()  # fra's streams hold after one chunk until it is set
    ids = itertools.count()
    results: list[tuple[str, float, int, bool]] = []
    stop = asyncio.Event()

    async def client() -> None:
        while not stop.is_set():
            prompt, started = f"req-{next(ids)}", time.monotonic()
            async with await cluster.post({**COMPLETION, "prompt": prompt, "stream": True}) as r:
                done = (await r.read()).endswith(b"data: [DONE]\n\n")
                results.append((prompt, started, r.status, done))

    async def until(condition: Callable[[], bool]) -> None:
        async with asyncio.timeout(60):  # a hang guard: each wait ends at its event
            while not condition():
                await asyncio.sleep(0.005)

    tasks = [asyncio.create_task(client()) for _ in range(4)]
    await until(lambda: cluster.fra.in_flight > 0)
    status, body = await admin(cluster, "POST", "/pops/fra/drain")
    acked = time.monotonic()
    assert status == 200 and body["draining"] is True and body["daemon_errors"] == {}
    assert body["in_flight"] > 0  # streams were running there when the drain was taken
    cluster.fra.gate.set()
    await until(lambda: any(started > acked and done for _, started, _, done in results))
    stop.set()
    await asyncio.gather(*tasks)

    assert results and all(status == 200 and done for _, _, status, done in results)
    reached_fra = {seen["body"]["prompt"] for seen in cluster.fra.seen}
    after = {prompt for prompt, started, _, _ in results if started > acked}
    assert after and not after & reached_fra
    assert cluster.fra.admin_calls == ["/admin/drain"]  # other routers see it in heartbeats
    assert cluster.fra.in_flight == 0

    status, body = await admin(cluster, "POST", "/pops/fra/undrain")
    assert status == 200 and body["draining"] is False
    await wait_placeable(cluster.app, 2)
    async with await cluster.post() as resp:
        assert resp.headers["x-edge-decode-pop"] == "fra"


@pytest.mark.asyncio
async def test_drain_one_daemon(cluster: Cluster) -> None:
    status, body = await admin(cluster, "POST", "/daemons/drain", json={"url": cluster.fra.url})
    assert status == 200 and body["state"] == "draining"
    async with await cluster.post() as resp:
        assert resp.headers["x-edge-decode-pop"] == "nyc"
    status, _ = await admin(cluster, "POST", "/daemons/undrain", json={"url": cluster.fra.url})
    assert status == 200 and cluster.fra.admin_calls == ["/admin/drain", "/admin/undrain"]


@pytest.mark.asyncio
async def test_reload_changes_the_pop_list(cluster: Cluster, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    write_config(cluster.config_path, {"fra": [cluster.fra]}, token_file)
    reload_pops(cluster.app)
    _, body = await admin(cluster, "GET", "/pops")
    assert [p["name"] for p in body["pops"]] == ["fra"]
    write_config(cluster.config_path, {"fra": [cluster.fra], "nyc": [cluster.nyc]}, token_file)
    reload_pops(cluster.app)
    await wait_placeable(cluster.app, 2)
    _, body = await admin(cluster, "GET", "/pops")
    assert [d["state"] for p in body["pops"] for d in p["daemons"]] == ["up", "up"]
