"""Remote prefill failures: dead, silent or stopped peers and peer aborts free every block.

No test here assumes how fast this host is: a transfer is held mid-way by a gate the test opens
(:func:`hold_exports`), a failure's cause is told by its reason (a timeout, or a disconnect
noticed while a long timeout was still running), and waits end on events.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zmq
import zmq.asyncio

from edgeinfer.daemon.kv_transfer.decode_client import PrefillFailed, RemotePrefillClient
from edgeinfer.daemon.kv_transfer.messages import Abort, KVChunk, Message, Ping, PrefillRequest
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
# A hang guard, not a speed assumption: every wait below ends at its event, long before this.
PATIENCE_S = 60.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("kv_failures"))


def zero_chunk(rid: str, seq: int, block: int) -> KVChunk:
    page = np.zeros(PAGE_BYTES, dtype=np.uint8)
    shape = (1, BLOCK_SIZE, 2, 16)
    return KVChunk(rid, seq, (0, 1), (block,), "bfloat16", (shape, shape), (page.data, page.data))


async def until(condition: Callable[[], bool], what: str) -> None:
    async with asyncio.timeout(PATIENCE_S):
        while not condition():
            await asyncio.sleep(0.005)
    assert condition(), what


@contextlib.asynccontextmanager
async def fake_prefill_peer(
    *, then_close: bool
) -> AsyncIterator[tuple[str, asyncio.Task[None], asyncio.Event]]:
    """A prefill 'server' that sends one KV chunk, then closes its socket, or goes silent
    until the yielded event is set and then sends a late chunk."""
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    endpoint = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    send_late = asyncio.Event()

    async def serve() -> None:
        req: Message = Ping("", 0)
        while isinstance(req, Ping):  # the client asks what this 'server' supports first
            identity, *frames = await router.recv_multipart()
            req = decode(frames)
        await router.send_multipart([identity, *encode(zero_chunk(req.rid, 0, 0))])
        if then_close:
            router.close(linger=0)
            return
        await send_late.wait()
        await router.send_multipart([identity, *encode(zero_chunk(req.rid, 1, 1))])

    task = asyncio.create_task(serve())
    try:
        yield endpoint, task, send_late
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        router.close(linger=0)
        ctx.term()


@pytest.mark.parametrize(
    ("then_close", "reason", "timeout_s"),
    # A closed peer is noticed long before a timeout would fire: the reason tells them apart.
    [(False, "timeout", 0.5), (True, "peer_disconnected", PATIENCE_S)],
)
async def test_peer_dying_mid_transfer_frees_reserved_blocks(
    checkpoint: Path, then_close: bool, reason: str, timeout_s: float
) -> None:
    decode_engine = await start_engine(checkpoint)
    client = RemotePrefillClient(decode_engine, stats=TransferStats(), timeout_s=timeout_s)
    try:
        async with fake_prefill_peer(then_close=then_close) as (endpoint, peer_task, send_late):
            with pytest.raises(PrefillFailed) as failure:
                await client.prefill("dying", prompt_of(100), GREEDY, endpoint)
            assert failure.value.reason == reason
            stats = decode_engine.engine.stats()
            assert stats.kv_blocks_used == 0 and stats.num_remote_pending == 0
            if not then_close:
                send_late.set()  # a chunk after the failure: dropped, counted
                await peer_task
                await until(lambda: client.stats.dropped["late"] > 0, "the late chunk")
                assert client.stats.dropped["late"] == 1
        assert client.stats.failures[reason] == 1
        assert client.stats.kv_chunks_received >= 1
    finally:
        await client.close()
        await decode_engine.stop()


@contextlib.contextmanager
def hold_exports(pair: Pair) -> Iterator[threading.Event]:
    """Each transfer exports its first KV chunk, then waits for the yielded event before the
    next (in the engine thread, as a slow export would): the test acts in the middle of it.
    Released on the way out, whatever happened."""
    export = pair.prefill.engine.export_kv
    release = threading.Event()
    exported: set[str] = set()

    def held(rid: str, *args: Any, **kwargs: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if rid in exported:
            release.wait(PATIENCE_S)
        exported.add(rid)
        return export(rid, *args, **kwargs)

    pair.prefill.engine.export_kv = held
    try:
        yield release
    finally:
        release.set()


async def test_server_killed_mid_transfer(checkpoint: Path) -> None:
    async with running_pair(checkpoint, timeout_s=PATIENCE_S) as pair:
        with hold_exports(pair) as release:
            stream = pair.decode.open_stream("killed")
            prefill = asyncio.create_task(
                pair.client.prefill("killed", prompt_of(200), GREEDY, pair.endpoint)
            )
            await until(lambda: pair.client.stats.kv_chunks_received > 0, "a first chunk")
            stopping = asyncio.create_task(pair.server.stop(drain=False))
            await asyncio.sleep(0)  # the stop cancels the transfer, held at its second export
            release.set()  # the held export returns into a cancelled transfer
            await stopping
        with pytest.raises(PrefillFailed) as failure:
            await prefill
        assert failure.value.reason == "peer_disconnected"
        pair.decode.close_stream("killed")
        assert stream.empty()
        assert pair.decode_blocks_used() == 0 and pair.prefill_blocks_used() == 0
        assert pair.server.stats.failures["server_stopped"] == 1


async def test_peer_abort_releases_prefill_blocks(checkpoint: Path) -> None:
    async with running_pair(checkpoint) as pair:
        ctx = zmq.asyncio.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.linger = 0
        dealer.connect(pair.endpoint)
        try:
            with hold_exports(pair) as release:
                for rid in ("abort-at-once", "abort-mid-transfer"):
                    req = PrefillRequest(rid, 0, tuple(prompt_of(200)), {}, (), LAYOUT)
                    await dealer.send_multipart(encode(req))
                    if rid == "abort-mid-transfer":
                        while (msg := decode(await dealer.recv_multipart())).rid != rid:
                            pass  # a first chunk of abort-at-once, if it got that far
                        assert msg.KIND == "kv"
                    await dealer.send_multipart(encode(Abort(rid, 1, "client went away")))
                await until(
                    lambda: pair.server.stats.failures["aborted_by_peer"] == 2, "both aborts"
                )
                release.set()
            await until(
                lambda: pair.server.in_flight == 0 and pair.prefill_blocks_used() == 0,
                "the transfers to end and free their blocks",
            )
            assert pair.server.stats.failures["aborted_by_peer"] == 2
            assert pair.server.stats.transfers_ok == 0
        finally:
            dealer.close(linger=0)
            ctx.term()


async def test_draining_stop_finishes_in_flight_and_refuses_new(checkpoint: Path) -> None:
    async with running_pair(checkpoint) as pair:
        with hold_exports(pair) as release:
            in_flight = asyncio.create_task(remote_generate(pair, "drain-1", prompt_of(200)))
            await until(lambda: pair.client.stats.kv_chunks_received > 0, "a first chunk")
            stopping = asyncio.create_task(pair.server.stop(drain=True))
            await asyncio.sleep(0)  # the stop's first step: draining from here on
            with pytest.raises(PrefillFailed) as refused:
                await pair.client.prefill("drain-2", prompt_of(20), GREEDY, pair.endpoint)
            assert refused.value.code == "draining"
            release.set()
        assert len(await in_flight) == GREEDY.max_tokens
        await stopping
        assert pair.server.stats.transfers_ok == 1
        assert pair.decode_blocks_used() == 0 and pair.prefill_blocks_used() == 0


async def test_bad_endpoint_and_dead_peer_fail_fast(checkpoint: Path) -> None:
    decode_engine = await start_engine(checkpoint)
    # A dead peer must be reported as such, long before this timeout could end the wait.
    client = RemotePrefillClient(decode_engine, timeout_s=PATIENCE_S)
    try:
        with pytest.raises(PrefillFailed) as bad:
            await client.prefill("bad", prompt_of(20), GREEDY, "not-an-endpoint")
        assert bad.value.reason == "bad_endpoint"
        with socket.socket() as s:  # a port that nobody listens on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with pytest.raises(PrefillFailed) as dead:
            await client.prefill("dead", prompt_of(20), GREEDY, f"tcp://127.0.0.1:{port}")
        assert dead.value.reason == "peer_unreachable"
        assert decode_engine.engine.stats().kv_blocks_used == 0
    finally:
        await client.close()
        await decode_engine.stop()
