"""kv_pull failures: a pull that does not complete costs time, never the answer or a block.

Each side is played by a fake peer speaking the wire protocol. A decode 'daemon' that offers
pages and then answers the prefill server's ``kv_pull`` with nothing, garbage, pages it was not
asked for or an error, or that dies: the server recomputes, numbers its messages without a
gap, answers the right first token and releases every block. A prefill 'daemon' that asks for
pages not offered, or twice: the decode client refuses with an ``error``, sends each offered
block once, and frees its blocks when the transfer fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import numpy as np
import pytest
import zmq
import zmq.asyncio

from edgeinfer.daemon.kv_transfer.decode_client import PrefillFailed
from edgeinfer.daemon.kv_transfer.messages import (
    FEATURE_KV_PULL,
    Abort,
    ErrorReply,
    FirstToken,
    KVChunk,
    KVPull,
    Message,
    Ping,
    Pong,
    PrefillRequest,
)
from edgeinfer.daemon.kv_transfer.wire import decode, encode
from kv_transfer_helpers import (
    BLOCK_SIZE,
    GREEDY,
    LAYOUT,
    NUM_LAYERS,
    PAGE_BYTES,
    Pair,
    build_checkpoint,
    prompt_of,
    reference_tokens,
    running_pair,
)

PATIENCE_S = 60.0  # a hang guard: every wait ends at its event long before this
PROMPT = prompt_of(60, offset=5)  # 3 full blocks and a partial one
HELD = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("kv_pull_failures"))


async def until(condition: Callable[[], bool], what: str) -> None:
    async with asyncio.timeout(PATIENCE_S):
        while not condition():
            await asyncio.sleep(0.005)
    assert condition(), what


def page_chunk(rid: str, seq: int, block: int) -> KVChunk:
    page = np.zeros(PAGE_BYTES, dtype=np.uint8)
    shape = (1, BLOCK_SIZE, 2, 16)
    return KVChunk(rid, seq, (0, 1), (block,), "bfloat16", (shape, shape), (page.data, page.data))


def corrupt(rid: str, seq: int) -> list[bytes]:
    frames = [bytes(f) for f in encode(page_chunk(rid, seq, 0))]
    frames[1] = b"\x01" + frames[1][1:]  # the payload no longer matches its CRC
    return frames


# What the fake decode side answers a kv_pull with (frames to send; None: close the socket).
ANSWERS: dict[str, Callable[[str], list[list[bytes]] | None]] = {
    "timeout": lambda rid: [],
    "corrupt": lambda rid: [corrupt(rid, 1)],
    "bad_chunk": lambda rid: [[bytes(f) for f in encode(page_chunk(rid, 1, HELD + 1))]],
    "refused": lambda rid: [[bytes(f) for f in encode(ErrorReply(rid, 1, "pull_refused", "x"))]],
}


def sampling() -> dict[str, object]:
    wire = dataclasses.asdict(GREEDY)
    wire["logit_bias"] = {}
    return wire


@contextlib.asynccontextmanager
async def dealer_to(endpoint: str) -> AsyncIterator[zmq.asyncio.Socket]:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(endpoint)
    try:
        yield sock
    finally:
        sock.close(linger=0)
        ctx.term()


async def receive(sock: zmq.asyncio.Socket) -> Message:
    async with asyncio.timeout(PATIENCE_S):
        return decode(await sock.recv_multipart())


async def assert_released(pair: Pair) -> None:
    await until(lambda: pair.prefill_blocks_used() == 0, "prefill blocks released")
    stats = pair.prefill.engine.stats()
    assert stats.num_remote_pending == 0 and stats.num_prefilled_held == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("reason", sorted(ANSWERS))
async def test_failed_pull_falls_back_to_recompute(checkpoint: Path, reason: str) -> None:
    want_first = reference_tokens(checkpoint, [PROMPT])[0][0]
    async with (
        running_pair(checkpoint, prefill_rate=lambda: 1.0, pull_timeout_s=0.3) as pair,
        dealer_to(pair.endpoint) as sock,
    ):
        rid = f"fail-{reason}"
        request = PrefillRequest(
            rid, 0, tuple(PROMPT), sampling(), tuple(range(HELD)), LAYOUT, offers_pages=True
        )
        await sock.send_multipart(encode(request))
        pull = await receive(sock)
        assert isinstance(pull, KVPull) and pull.seq == 0 and pull.blocks == (0, 1, 2)
        for frames in ANSWERS[reason](rid) or []:
            await sock.send_multipart(frames)
        got: list[Message] = [pull]
        while not isinstance(got[-1], FirstToken):
            got.append(await receive(sock))
        # Recomputed: the pushed pages are what the decode side lacks, numbered on from the
        # kv_pull without a gap, and the first token is one engine's.
        assert [m.seq for m in got] == list(range(len(got)))
        chunks = [m for m in got if isinstance(m, KVChunk)]
        owed = {(layer, b) for layer in range(NUM_LAYERS) for b in range(HELD, 4)}
        sent = [(layer, b) for c in chunks for layer in range(*c.layers) for b in c.blocks]
        assert sorted(sent) == sorted(owed)
        first = got[-1]
        assert isinstance(first, FirstToken)
        assert first.token == want_first and first.num_computed == len(PROMPT)
        await assert_released(pair)
        assert pair.server.stats.pull_fallbacks == {reason: 1}
        assert pair.server.stats.pulled_blocks == 0


@pytest.mark.asyncio
async def test_decode_side_dying_mid_pull_leaks_nothing(checkpoint: Path) -> None:
    async with running_pair(checkpoint, prefill_rate=lambda: 1.0, pull_timeout_s=0.3) as pair:
        async with dealer_to(pair.endpoint) as sock:
            request = PrefillRequest(
                "dies", 0, tuple(PROMPT), sampling(), (0, 1, 2), LAYOUT, offers_pages=True
            )
            await sock.send_multipart(encode(request))
            assert isinstance(await receive(sock), KVPull)
        # Gone: the pull times out, the recompute's pages find no peer, everything is freed.
        await until(lambda: pair.server.stats.failures["peer_gone"] == 1, "the peer noticed gone")
        await assert_released(pair)
        assert pair.server.stats.pull_fallbacks == {"timeout": 1}


@contextlib.asynccontextmanager
async def fake_prefill() -> AsyncIterator[tuple[zmq.asyncio.Socket, str]]:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield sock, f"tcp://127.0.0.1:{port}"
    finally:
        sock.close(linger=0)
        ctx.term()


@pytest.mark.asyncio
async def test_decode_side_serves_only_offered_blocks_once(checkpoint: Path) -> None:
    async with (
        running_pair(checkpoint, timeout_s=0.5) as pair,
        fake_prefill() as (router, endpoint),
    ):
        # Warm the decode side's cache with the prompt: it then holds (and offers) 3 blocks.
        async for _ in pair.decode.generate("warm", PROMPT, GREEDY):
            pass

        async def peer() -> list[Message]:
            """Say it pulls, then ask beyond the offer, for blocks 0-1, and for block 1 again;
            return what it received, up to the decode side's abort."""
            seen: list[Message] = []
            while not seen or not isinstance(seen[-1], Abort):
                identity, *frames = await router.recv_multipart()
                msg = decode(frames)
                seen.append(msg)
                if isinstance(msg, Ping):
                    pong = Pong("", msg.seq, (FEATURE_KV_PULL,))
                    await router.send_multipart([identity, *encode(pong)])
                elif isinstance(msg, PrefillRequest):
                    for seq, blocks in enumerate([(HELD,), (0, 1), (1,)]):
                        pull = KVPull(msg.rid, seq, blocks)
                        await router.send_multipart([identity, *encode(pull)])
            return seen

        task = asyncio.create_task(peer())
        pair.client.connect(endpoint)
        await until(lambda: pair.client.peer_features(endpoint) is not None, "the pong")
        with pytest.raises(PrefillFailed) as failure:
            await pair.client.prefill("greedy-peer", PROMPT, GREEDY, endpoint)
        assert failure.value.reason == "timeout"  # the fake never sends the rest
        seen = await task
        req = next(m for m in seen if isinstance(m, PrefillRequest))
        assert req.offers_pages and req.held_blocks == (0, 1, 2)
        replies = [m for m in seen if m.rid == req.rid and not isinstance(m, PrefillRequest)]
        # Refused (beyond the offer), blocks 0-1 for every layer, refused (block 1 again),
        # then the abort: numbered on from the request without a gap.
        assert [m.seq for m in replies] == list(range(1, len(replies) + 1))
        refusals = [m for m in replies if isinstance(m, ErrorReply)]
        assert [m.code for m in refusals] == ["pull_refused", "pull_refused"]
        assert replies[0] is refusals[0] and replies[-2] is refusals[1]
        chunks = [m for m in replies if isinstance(m, KVChunk)]
        served = [(layer, b) for c in chunks for layer in range(*c.layers) for b in c.blocks]
        assert sorted(served) == sorted((layer, b) for layer in range(NUM_LAYERS) for b in (0, 1))
        assert pair.client.stats.pulled_blocks == 2
        assert pair.client.stats.dropped["bad_pull"] == 2
        # The offered blocks were pinned by the reserved request; now all are free again.
        stats = pair.decode.engine.stats()
        assert stats.num_remote_pending == 0 and pair.decode_blocks_used() == 0
