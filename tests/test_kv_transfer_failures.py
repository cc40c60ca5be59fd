"""Remote prefill failures: dead, silent or stopped peers and peer aborts free every block."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zmq
import zmq.asyncio

from edgeinfer.daemon.kv_transfer.decode_client import PrefillFailed, RemotePrefillClient
from edgeinfer.daemon.kv_transfer.messages import Abort, KVChunk, PrefillRequest
from edgeinfer.daemon.kv_transfer.stats import TransferStats
from edgeinfer.daemon.kv_transfer.wire import decode, encode
from kv_transfer_helpers import (
    BLOCK_SIZE,
    GREEDY,
    LAYOUT,
    PAGE_BYTES,
    Pair,
    build_checkpoint,
    prompt_of,
    remote_generate,
    running_pair,
    start_engine,
)

pytestmark = pytest.mark.asyncio


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("kv_failures"))


def zero_chunk(rid: str, seq: int, block: int) -> KVChunk:
    page = np.zeros(PAGE_BYTES, dtype=np.uint8)
    shape = (1, BLOCK_SIZE, 2, 16)
    return KVChunk(rid, seq, (0, 1), (block,), "bfloat16", (shape, shape), (page.data, page.data))


@contextlib.asynccontextmanager
async def fake_prefill_peer(*, then_close: bool) -> AsyncIterator[tuple[str, asyncio.Task[None]]]:
    """A prefill 'server' that sends one KV chunk, then goes silent or closes its socket."""
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    endpoint = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"

    async def serve() -> None:
        identity, *frames = await router.recv_multipart()
        req = decode(frames)
        await router.send_multipart([identity, *encode(zero_chunk(req.rid, 0, 0))])
        if then_close:
            router.close(linger=0)
            return
        await asyncio.sleep(0.8)  # silent past the client's timeout, then a late chunk
        await router.send_multipart([identity, *encode(zero_chunk(req.rid, 1, 1))])

    task = asyncio.create_task(serve())
    try:
        yield endpoint, task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        router.close(linger=0)
        ctx.term()


@pytest.mark.parametrize(
    ("then_close", "reason"), [(False, "timeout"), (True, "peer_disconnected")]
)
async def test_peer_dying_mid_transfer_frees_reserved_blocks(
    checkpoint: Path, then_close: bool, reason: str
) -> None:
    decode_engine = await start_engine(checkpoint)
    client = RemotePrefillClient(decode_engine, stats=TransferStats(), timeout_s=0.5)
    try:
        async with fake_prefill_peer(then_close=then_close) as (endpoint, peer_task):
            start = time.monotonic()
            with pytest.raises(PrefillFailed) as failure:
                await client.prefill("dying", prompt_of(100), GREEDY, endpoint)
            elapsed = time.monotonic() - start
            assert failure.value.reason == reason
            assert elapsed < 1.0  # the timeout is 0.5 s; a closed peer is noticed at once
            stats = decode_engine.engine.stats()
            assert stats.kv_blocks_used == 0 and stats.num_remote_pending == 0
            if not then_close:
                await peer_task  # its late chunk arrives after the failure: dropped, counted
                for _ in range(100):
                    if client.stats.dropped["late"]:
                        break
                    await asyncio.sleep(0.01)
                assert client.stats.dropped["late"] == 1
        assert client.stats.failures[reason] == 1
        assert client.stats.kv_chunks_received >= 1
    finally:
        await client.close()
        await decode_engine.stop()


def slow_down_export(pair: Pair) -> None:
    """Stretch a transfer so that the test can act in the middle of it."""
    export = pair.prefill.engine.export_kv

    def export_slowly(*args: Any, **kwargs: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        time.sleep(0.05)
        return export(*args, **kwargs)

    pair.prefill.engine.export_kv = export_slowly


async def test_server_killed_mid_transfer(checkpoint: Path) -> None:
    async with running_pair(checkpoint, timeout_s=5.0) as pair:
        slow_down_export(pair)
        stream = pair.decode.open_stream("killed")
        prefill = asyncio.create_task(
            pair.client.prefill("killed", prompt_of(200), GREEDY, pair.endpoint)
        )
        while pair.client.stats.kv_chunks_received == 0:
            await asyncio.sleep(0.005)
        start = time.monotonic()
        await pair.server.stop(drain=False)
        with pytest.raises(PrefillFailed) as failure:
            await prefill
        assert failure.value.reason == "peer_disconnected"
        assert time.monotonic() - start < 2.0
        pair.decode.close_stream("killed")
        assert stream.empty()
        assert pair.decode_blocks_used() == 0 and pair.prefill_blocks_used() == 0
        assert pair.server.stats.failures["server_stopped"] == 1


async def test_peer_abort_releases_prefill_blocks(checkpoint: Path) -> None:
    async with running_pair(checkpoint) as pair:
        slow_down_export(pair)
        ctx = zmq.asyncio.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.linger = 0
        dealer.connect(pair.endpoint)
        try:
            for rid in ("abort-at-once", "abort-mid-transfer"):
                req = PrefillRequest(rid, 0, tuple(prompt_of(200)), {}, (), LAYOUT)
                await dealer.send_multipart(encode(req))
                if rid == "abort-mid-transfer":
                    assert decode(await dealer.recv_multipart()).KIND == "kv"
                await dealer.send_multipart(encode(Abort(rid, 1, "client went away")))
            for _ in range(200):
                if pair.server.in_flight == 0 and pair.prefill_blocks_used() == 0:
                    break
                await asyncio.sleep(0.01)
            assert pair.server.in_flight == 0 and pair.prefill_blocks_used() == 0
            assert pair.server.stats.failures["aborted_by_peer"] == 2
            assert pair.server.stats.transfers_ok == 0
        finally:
            dealer.close(linger=0)
            ctx.term()


async def test_draining_stop_finishes_in_flight_and_refuses_new(checkpoint: Path) -> None:
    async with running_pair(checkpoint) as pair:
        slow_down_export(pair)
        in_flight = asyncio.create_task(remote_generate(pair, "drain-1", prompt_of(200)))
        while pair.server.in_flight == 0:
            await asyncio.sleep(0.005)
        stopping = asyncio.create_task(pair.server.stop(drain=True))
        await asyncio.sleep(0.01)
        with pytest.raises(PrefillFailed) as refused:
            await pair.client.prefill("drain-2", prompt_of(20), GREEDY, pair.endpoint)
        assert refused.value.code == "draining"
        assert len(await in_flight) == GREEDY.max_tokens
        await stopping
        assert pair.server.stats.transfers_ok == 1
        assert pair.decode_blocks_used() == 0 and pair.prefill_blocks_used() == 0


async def test_bad_endpoint_and_dead_peer_fail_fast(checkpoint: Path) -> None:
    decode_engine = await start_engine(checkpoint)
    client = RemotePrefillClient(decode_engine, timeout_s=5.0)
    try:
        with pytest.raises(PrefillFailed) as bad:
            await client.prefill("bad", prompt_of(20), GREEDY, "not-an-endpoint")
        assert bad.value.reason == "bad_endpoint"
        with socket.socket() as s:  # a port that nobody listens on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(PrefillFailed) as dead:
            await client.prefill("dead", prompt_of(20), GREEDY, f"tcp://127.0.0.1:{port}")
        assert dead.value.reason == "peer_unreachable"
        assert time.monotonic() - start < 2.0
        assert decode_engine.engine.stats().kv_blocks_used == 0
    finally:
        await client.close()
        await decode_engine.stop()
