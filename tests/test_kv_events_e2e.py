"""A real daemon process tells a router's prefix index what its cache holds: the keys of a
served prompt (the engine's own hashes of the token ids and the tenant's salt), evictions, a
late subscriber's snapshot, a lost batch's resync and a restart's clearing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest
import zmq.asyncio

from cluster import Cluster, Proc, cluster, wait_healthy
from edgeinfer.daemon.api.cache_salt import effective_cache_salt
from edgeinfer.daemon.engine.block_manager import block_hash, salt_key
from edgeinfer.daemon.engine.tiny_checkpoint import build_tiny_checkpoint
from edgeinfer.router.heartbeat_listener import HeartbeatListener
from edgeinfer.router.kv_sync import SnapshotFetcher
from edgeinfer.router.pop_registry import PopConfig, PopRegistry
from edgeinfer.router.prefix_index import sorted_keys
from edgeinfer.shared import processes
from edgeinfer.shared.heartbeat import KvEvents, KvSnapshot, decode_message

BLOCK = 16
PERIOD = 0.3  # the cluster's daemon heartbeat interval
NUM_BLOCKS = "16"  # three 7-block requests cannot all stay cached: the third evicts
TENANT = "tenant-a"


def prompt(seed: int) -> list[int]:
    return [random.Random(seed).randrange(3, 512) for _ in range(100)]  # 6 full blocks


def engine_keys(tokens: list[int], header_salt: str | None) -> list[bytes]:
    """The block keys the engine computes for ``tokens`` under the router's salt header."""
    parent, keys = salt_key(effective_cache_salt(header_salt, None)), []
    for i in range(len(tokens) // BLOCK):
        parent = block_hash(parent, tokens[i * BLOCK : (i + 1) * BLOCK])
        keys.append(parent)
    return keys


def complete(url: str, tokens: list[int]) -> None:
    body = {"prompt": tokens, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "x-edge-cache-salt": TENANT},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200


def daemon_snapshot(url: str) -> KvSnapshot:
    with urllib.request.urlopen(url + "/v1/kv_snapshot", timeout=30) as resp:
        return KvSnapshot.decode(resp.read())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("kv_events") / "m", num_layers=2)


class Router:
    """A router's registry, heartbeat listener and snapshot fetcher, in this process."""

    def __init__(self, daemon: Proc) -> None:
        self.daemon = daemon
        self.registry = PopRegistry([PopConfig("local", 0.0, 0.0, (daemon.url,))], "local", PERIOD)
        self.ctx = zmq.asyncio.Context()
        self.listener = HeartbeatListener(self.registry, PERIOD, context=self.ctx)
        self.drop: Callable[[KvEvents], bool] = lambda ev: False
        handle = self.listener.handle

        def filtered(frames: list[bytes]) -> None:
            msg = decode_message(frames[0])
            if isinstance(msg, KvEvents) and self.drop(msg):
                return  # as if the PUB socket had dropped it for a slow subscriber
            handle(frames)

        self.listener.handle = filtered  # type: ignore[method-assign]

    def hits(self, tokens: list[int]) -> int:
        return self.registry.prefix_index.lookup(engine_keys(tokens, TENANT)).get(
            self.daemon.url, 0
        )

    async def wait(self, predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not predicate():
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"not met in time; counts {self.registry.kv.counts}")
            await asyncio.sleep(0.02)

    async def matches_daemon(self) -> bool:
        """The index holds exactly what the daemon's own snapshot says, at its seq."""
        snap = await asyncio.to_thread(daemon_snapshot, self.daemon.url)
        have = self.registry.prefix_index._daemons.get(self.daemon.url)
        if have is None:
            return not snap.keys
        have.merge()
        return (
            bool((have.base == sorted_keys(snap.keys)).all())
            and len(have.base) == len(snap.keys) // 16
        )


@contextlib.asynccontextmanager
async def in_process_router(daemon: Proc) -> AsyncIterator[Router]:
    router = Router(daemon)
    session = aiohttp.ClientSession()
    fetcher = SnapshotFetcher(router.registry.kv, session, retry_s=0.1)
    router.listener.subscribe(daemon.tcp_endpoint("hb"))
    await router.listener.start()
    await fetcher.start()
    try:
        yield router
    finally:
        await fetcher.stop()
        await router.listener.stop()
        await session.close()
        router.ctx.term()


def restart(c: Cluster, proc: Proc) -> Proc:
    proc.kill()
    proc.popen.wait()
    env = {
        "EDGEINFER_HEARTBEAT_PORT": str(proc.ports["hb"]), "EDGEINFER_NUM_KV_BLOCKS": NUM_BLOCKS,
        "EDGEINFER_NUM_THREADS": "1", "EDGEINFER_HEARTBEAT_INTERVAL_S": str(PERIOD),
    }  # fmt: skip
    args = [str(a) for a in proc.popen.args]  # type: ignore[union-attr]
    new = processes.spawn(
        proc.name + "-restarted", args, workdir=c.workdir, url=proc.url, env=env, ports=proc.ports
    )
    c.procs.append(new)
    return new


@pytest.mark.asyncio
async def test_index_follows_a_real_daemon(checkpoint: Path, tmp_path: Path) -> None:
    assert sys.platform.startswith("linux")
    with cluster(tmp_path) as c:
        daemon = c.daemon("d", checkpoint, env={"EDGEINFER_NUM_KV_BLOCKS": NUM_BLOCKS})
        await asyncio.to_thread(wait_healthy, daemon)
        # Served before any router listens: a late subscriber learns it from a snapshot.
        await asyncio.to_thread(complete, daemon.url, prompt(1))
        async with in_process_router(daemon) as router:
            await router.wait(lambda: router.hits(prompt(1)) == 6)
            assert router.registry.kv.counts["snapshots"] == 1
            # Other tenants' keys never match: the salt is in the chain.
            assert router.registry.prefix_index.lookup(engine_keys(prompt(1), "other")) == {}

            # Live events: a second prompt appears without a snapshot.
            await asyncio.to_thread(complete, daemon.url, prompt(2))
            await router.wait(lambda: router.hits(prompt(2)) == 6)
            # The third evicts the oldest-freed blocks (the first prompt's tail first).
            await asyncio.to_thread(complete, daemon.url, prompt(3))
            await router.wait(lambda: router.hits(prompt(3)) == 6)
            await router.wait(lambda: router.hits(prompt(1)) < 6)
            assert router.registry.kv.counts["snapshots"] == 1
            assert await router.matches_daemon()

            # A lost batch: the next heartbeat counts it, the router fetches a snapshot.
            dropped: list[KvEvents] = []

            def drop_one(ev: KvEvents) -> bool:
                if dropped:
                    return False
                dropped.append(ev)
                return True

            router.drop = drop_one
            await asyncio.to_thread(complete, daemon.url, prompt(4))
            await router.wait(lambda: router.registry.kv.counts["snapshots"] == 2)
            await router.wait(lambda: router.hits(prompt(4)) == 6)
            assert router.registry.kv.counts["gaps"] >= 1
            assert await router.matches_daemon()

            # A restart: the new process holds nothing, and neither does the index.
            daemon = restart(c, daemon)
            router.daemon = daemon
            await asyncio.to_thread(wait_healthy, daemon)
            await router.wait(lambda: router.registry.kv.counts["restarts"] == 1)
            assert router.hits(prompt(4)) == 0
            await asyncio.to_thread(complete, daemon.url, prompt(5))
            await router.wait(lambda: router.hits(prompt(5)) == 6)
            assert await router.matches_daemon()
