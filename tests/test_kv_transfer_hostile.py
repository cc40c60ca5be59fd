"""Garbage, truncated and replayed frames at the prefill server: counted, dropped, harmless."""

from __future__ import annotations

import asyncio
import os
import struct
import zlib
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
import zmq.asyncio

from edgeinfer.daemon.kv_transfer.messages import (
    Abort,
    FirstToken,
    KVChunk,
    Message,
    PrefillRequest,
)
from edgeinfer.daemon.kv_transfer.wire import decode, encode
from kv_transfer_helpers import (
    BLOCK_SIZE,
    LAYOUT,
    PAGE_BYTES,
    build_checkpoint,
    prompt_of,
    reference_tokens,
    remote_generate,
    running_pair,
)

pytestmark = pytest.mark.asyncio


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("kv_hostile"))


def with_header(header: dict[str, Any], *payloads: bytes) -> list[bytes]:
    """Frames with a valid header CRC, to get past the checksum to the field checks."""
    packed = msgpack.packb(header)
    return [struct.pack(">I", zlib.crc32(packed)) + packed, *payloads]


def request_frames(rid: str) -> list[bytes]:
    return [bytes(f) for f in encode(PrefillRequest(rid, 0, tuple(prompt_of(20)), {}, (), LAYOUT))]


async def replies_until_first_token(dealer: zmq.asyncio.Socket, rid: str) -> list[Message]:
    got: list[Message] = []
    async with asyncio.timeout(5.0):
        while True:
            msg = decode(await dealer.recv_multipart())
            if msg.rid == rid:
                got.append(msg)
                if isinstance(msg, FirstToken):
                    return got


async def test_hostile_frames_are_dropped_and_service_continues(checkpoint: Path) -> None:
    prompt = prompt_of(33, offset=77)
    want = reference_tokens(checkpoint, [prompt])[0]
    page = np.zeros(PAGE_BYTES, dtype=np.uint8)
    shape = (1, BLOCK_SIZE, 2, 16)
    stray_chunk = KVChunk("x", 0, (0, 1), (0,), "bfloat16", (shape, shape), (page.data, page.data))
    header = request_frames("extra")[0]
    hostile = {
        "checksum": [[b"garbage"], [header[: len(header) // 2]]],  # random and truncated
        "malformed": [[b"\x00"]],
        "size_mismatch": [[header, b"payload on a prefill_req"]],
        "unknown_kind": [with_header({"v": 1, "rid": "x", "kind": "nope", "seq": 0})],
        "bad_version": [with_header({"v": 9, "rid": "x", "kind": "abort", "seq": 0})],
        "unexpected_kind": [[bytes(f) for f in encode(FirstToken("x", 0, 1, None, (), 1, False))]],
        # A kv message reaches the server only as an answer to its kv_pull, for a live request.
        "unknown_rid": [
            [bytes(f) for f in encode(Abort("nobody", 1, ""))],
            [bytes(f) for f in encode(stray_chunk)],
        ],
    }
    async with running_pair(checkpoint) as pair:
        ctx = zmq.asyncio.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.linger = 0
        dealer.connect(pair.endpoint)
        try:
            for frame_sets in hostile.values():
                for frames in frame_sets:
                    await dealer.send_multipart(frames)
            # A replay after the request finished, and one while it is still in flight.
            replayed = request_frames("replayed")
            await dealer.send_multipart(replayed)
            kinds = [m.KIND for m in await replies_until_first_token(dealer, "replayed")]
            assert kinds[-1] == "first_token" and set(kinds[:-1]) == {"kv"}
            await dealer.send_multipart(replayed)
            twice = request_frames("twice")
            await dealer.send_multipart(twice)
            await dealer.send_multipart(twice)
            await replies_until_first_token(dealer, "twice")

            dropped = pair.server.stats.dropped
            for reason, frame_sets in hostile.items():
                assert dropped[reason] == len(frame_sets), reason
            assert dropped["late"] + dropped["duplicate"] == 2

            # Random bytes on a raw TCP connection: libzmq may parse them as ZMTP/1.0 frames,
            # which then fail our checks like any other garbage.
            host, port = pair.endpoint.removeprefix("tcp://").rsplit(":", 1)
            _, writer = await asyncio.open_connection(host, int(port))
            writer.write(os.urandom(1 << 16))
            await writer.drain()
            writer.close()
            await asyncio.sleep(0.1)

            # The server still serves a real decode client correctly.
            assert await remote_generate(pair, "after-garbage", prompt) == want
        finally:
            dealer.close(linger=0)
            ctx.term()
        assert pair.server.stats.transfers_ok == 3  # replayed, twice, after-garbage
        assert pair.server.in_flight == 0 and pair.prefill_blocks_used() == 0
