"""KV-transfer wire protocol: round trips, zero copy, strict validation, duplicate filtering."""

from __future__ import annotations

import contextlib
import struct
import uuid
import zlib
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from edgeinfer.daemon.kv_transfer import (
    Abort,
    DuplicateFilter,
    ErrorReply,
    FirstToken,
    KVChunk,
    Message,
    Ping,
    Pong,
    PrefillRequest,
    WireError,
    WireLayout,
    WireLimits,
    decode,
    encode,
)

LAYOUT = WireLayout("bfloat16", block_size=16, num_layers=4, num_kv_heads=2, head_dim=8)


def kv_chunk() -> tuple[KVChunk, np.ndarray]:
    keys = np.random.default_rng(0).random((2, 3, 16, 2, 8), dtype=np.float32)
    return KVChunk("req-1", 0, (0, 2), (5, 6, 9), "float32", (keys.shape,), (keys.data,)), keys


SMALL_MESSAGES: list[Message] = [
    PrefillRequest(
        "r", 0, (1, 2, 3), {"temperature": 0.7, "stop": ["\n"], "bias": {"7": -1.0}}, (0, 2), LAYOUT
    ),
    PrefillRequest("r", 0, (1, 2, 3), {}, (), LAYOUT, "3f2a" * 8),
    FirstToken("r", 4, 17, -0.25, ((17, -0.25), (3, -2.0)), 3, False),
    FirstToken("r", 0, 2, None, (), 1, True),
    ErrorReply("r", 1, "capacity", "KV cache full"),
    Abort("r", 1, "client went away"),
    Ping("", 7),
    Pong("", 7),
]


def with_header(header: dict[str, Any], *payloads: bytes) -> list[bytes]:
    """Frames with a valid header CRC, to reach the field validation behind it."""
    packed = msgpack.packb(header)
    return [struct.pack(">I", zlib.crc32(packed)) + packed, *payloads]


def valid_kv_frames() -> list[bytes]:
    return [bytes(f) for f in encode(kv_chunk()[0])]


def kv_header_with(**fields: Any) -> list[bytes]:
    frames = valid_kv_frames()
    header = {**msgpack.unpackb(frames[0][4:]), **fields}
    return with_header({k: v for k, v in header.items() if v is not None}, *frames[1:])


@pytest.mark.parametrize("msg", SMALL_MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip_small(msg: Message) -> None:
    frames = encode(msg)
    assert len(frames) == 1
    assert decode(frames) == msg


@pytest.mark.parametrize(
    ("dtype", "array"),
    [
        ("float32", np.random.default_rng(0).random((2, 16, 2, 8), dtype=np.float32)),
        ("float16", np.ones((4, 16, 2, 8), dtype=np.float16)),
        # bfloat16 has no numpy dtype: the daemon sends the raw 2-byte words as uint16.
        ("bfloat16", np.arange(2 * 16 * 2 * 8, dtype=np.uint16).reshape(2, 16, 2, 8)),
    ],
)
def test_kv_round_trip_over_zmq(dtype: str, array: np.ndarray) -> None:
    empty = np.zeros((0, 16, 2, 8), dtype=array.dtype)
    msg = KVChunk(
        "req",
        3,
        (1, 3),
        (4, 7),
        dtype,
        (array.shape, empty.shape),
        (array, empty.data),  # type: ignore[arg-type]  # a bare ndarray works at run time
    )
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    # A closed socket releases its inproc name asynchronously (in zmq's I/O thread), so each
    # case binds its own name rather than reusing one the previous case may still hold.
    address = f"inproc://kv-round-trip-{uuid.uuid4().hex}"
    with ctx.socket(zmq.PAIR) as tx, ctx.socket(zmq.PAIR) as rx:
        rx.bind(address)
        tx.connect(address)
        tx.send_multipart(encode(msg), copy=False)
        got = decode(rx.recv_multipart(copy=False))
    assert isinstance(got, KVChunk)
    assert (got.rid, got.seq, got.layers, got.blocks, got.dtype) == (
        "req",
        3,
        (1, 3),
        (4, 7),
        dtype,
    )
    assert got.shapes == (array.shape, empty.shape)
    restored = np.frombuffer(got.frames[0], dtype=array.dtype).reshape(got.shapes[0])
    np.testing.assert_array_equal(restored, array)
    assert got.frames[1].nbytes == 0


def test_payload_frames_are_zero_copy() -> None:
    chunk, keys = kv_chunk()
    frames = encode(chunk)
    assert np.shares_memory(np.frombuffer(frames[1], dtype=np.uint8), keys)
    decoded = decode(frames)
    assert isinstance(decoded, KVChunk)
    keys[0, 0, 0, 0, 0] = 42.0  # visible through the decoded view: nothing was copied
    assert np.frombuffer(decoded.frames[0], dtype=np.float32)[0] == 42.0


@pytest.mark.parametrize(
    ("build", "reason"),
    [
        (
            lambda a: KVChunk("r", 0, (0, 1), (), "float32", (a.shape,), (a[:, ::2].data,)),
            "malformed",
        ),
        (lambda a: KVChunk("r", 0, (0, 1), (), "int8", (a.shape,), (a.data,)), "malformed"),
        (
            lambda a: KVChunk("r", 0, (0, 1), (), "float32", ((3,),), (a.data,)),
            "size_mismatch",
        ),
        (lambda a: KVChunk("r", 0, (0, 1), (), "float32", (), (a.data,)), "size_mismatch"),
        (
            lambda a: KVChunk("r", 0, (2, 1), (), "float32", (a.shape,), (a.data,)),
            "malformed",
        ),
        (
            lambda a: KVChunk("r", 0, (0, 1), (1, 1), "float32", (a.shape,), (a.data,)),
            "malformed",
        ),
        (lambda a: PrefillRequest("r", 0, (), {}, (), LAYOUT), "malformed"),
        (lambda a: PrefillRequest("r", 0, (1,), {}, (), LAYOUT, ""), "malformed"),
        (lambda a: WireLayout("float32", 0, 1, 1, 1), "malformed"),
    ],
)
def test_sender_cannot_build_invalid_messages(build: Any, reason: str) -> None:
    with pytest.raises(WireError) as info:
        build(np.zeros((4, 4), dtype=np.float32))
    assert info.value.reason == reason


HEADER = {"v": 1, "rid": "r", "kind": "abort", "seq": 0, "reason": ""}


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([], "malformed"),
        ([b"\x00\x00"], "malformed"),
        ([b"\x00\x00\x00\x00\x80"], "checksum"),
        (with_header({**HEADER, "v": 2}), "bad_version"),
        (with_header({**HEADER, "kind": "teleport"}), "unknown_kind"),
        (with_header({**HEADER, "extra": 1}), "malformed"),
        (with_header({**HEADER, "seq": True}), "malformed"),
        (with_header({**HEADER, "seq": -1}), "malformed"),
        (with_header({**HEADER, "rid": ""}), "malformed"),
        (with_header({**HEADER, "rid": "x" * 300}), "malformed"),
        (with_header([1, 2]), "malformed"),  # type: ignore[arg-type]
        (with_header(HEADER, b"stray payload"), "size_mismatch"),
        (valid_kv_frames()[:1], "size_mismatch"),
        ([*valid_kv_frames(), b"more"], "size_mismatch"),
        ([*valid_kv_frames()[:1], valid_kv_frames()[1][:-4]], "size_mismatch"),
        ([*valid_kv_frames()[:1], b"\x01" + valid_kv_frames()[1][1:]], "checksum"),
        # Payloads travel as frames only, never in a header.
        (with_header({**HEADER, "kind": "kv_pull", "blocks": []}), "malformed"),
        (kv_header_with(payloads=[bytes(2 * 3 * 16 * 2 * 8 * 4)]), "malformed"),
        (kv_header_with(nbytes=None), "malformed"),
    ],
)
def test_decode_rejects(frames: list[bytes], reason: str) -> None:
    with pytest.raises(WireError) as info:
        decode(frames)
    assert info.value.reason == reason


def prefill_header(**fields: Any) -> dict[str, Any]:
    header = msgpack.unpackb(bytes(encode(SMALL_MESSAGES[0])[0])[4:])
    return {**header, **fields}


def test_cache_salt_is_optional_on_the_wire() -> None:
    # Unsalted requests leave the field out: a peer that predates it reads them unchanged.
    assert "cache_salt" not in prefill_header()
    got = decode(with_header(prefill_header()))
    assert isinstance(got, PrefillRequest) and got.salt is None
    got = decode(with_header(prefill_header(cache_salt="tenant-a")))
    assert isinstance(got, PrefillRequest) and got.cache_salt == "tenant-a"


@pytest.mark.parametrize("salt", [7, None, "", "x" * 257, ["a"], b"bytes"])
def test_bad_cache_salt_is_refused_naming_the_request(salt: Any) -> None:
    with pytest.raises(WireError) as info:
        decode(with_header(prefill_header(rid="req-5", cache_salt=salt)))
    assert info.value.reason == "malformed" and info.value.rid == "req-5"
    assert "cache_salt" in str(info.value)


def test_error_names_rid_once_known() -> None:
    with pytest.raises(WireError) as info:
        decode(with_header({**HEADER, "rid": "req-9", "seq": "0"}))
    assert info.value.rid == "req-9"


def test_limits() -> None:
    frames = valid_kv_frames()
    for limits in (
        WireLimits(max_message_bytes=len(frames[1])),
        WireLimits(max_payload_frames=0),
        WireLimits(max_header_bytes=16),
    ):
        with pytest.raises(WireError) as info:
            decode(frames, limits=limits)
        assert info.value.reason == "too_large"


VALID = [bytes(f) for m in (SMALL_MESSAGES[0], kv_chunk()[0]) for f in encode(m)]
FUZZ = settings(max_examples=300, deadline=None)


@FUZZ
@given(st.lists(st.binary(max_size=64), max_size=6))
def test_garbage_always_raises_wire_error(frames: list[bytes]) -> None:
    with pytest.raises(WireError):
        decode(frames)


@FUZZ
@given(st.sampled_from([encode(SMALL_MESSAGES[0]), encode(kv_chunk()[0])]), st.data())
def test_bit_flip_and_truncation_raise_wire_error(frames: list[Any], data: st.DataObject) -> None:
    frames = [bytearray(f) for f in frames]
    victim = data.draw(st.integers(0, len(frames) - 1))
    if data.draw(st.booleans()):
        bit = data.draw(st.integers(0, len(frames[victim]) * 8 - 1))
        frames[victim][bit // 8] ^= 1 << (bit % 8)
    elif data.draw(st.booleans()):
        del frames[victim][data.draw(st.integers(0, len(frames[victim]) - 1)) :]
    else:
        del frames[victim:]
    with pytest.raises(WireError):
        decode(frames)


_scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text()
_values = st.recursive(
    _scalars | st.binary(),
    lambda kids: st.lists(kids) | st.dictionaries(st.text(), kids),
    max_leaves=4,
)
_FIELDS = [
    "layers",
    "blocks",
    "dtype",
    "shape",
    "nbytes",
    "crc",
    "prompt",
    "sampling",
    "held_blocks",
    "layout",
    "cache_salt",
    "offers_pages",
    "features",
    "payloads",
    "token",
    "logprob",
    "top_logprobs",
    "num_computed",
    "done",
    "code",
    "message",
    "reason",
    "x",
]
_KINDS = ["prefill_req", "kv", "kv_pull", "first_token", "error", "abort", "ping", "pong"]
_headers = st.fixed_dictionaries(
    {
        "v": st.just(1) | _values,
        "rid": st.just("r") | _values,
        "kind": st.sampled_from(_KINDS) | _values,
        "seq": st.integers(0, 3) | _values,
    },
    optional={k: _values for k in _FIELDS},
)


@settings(max_examples=150, deadline=None)
@given(_headers | _values, st.lists(st.binary(max_size=16), max_size=3))
def test_any_checksummed_header_decodes_or_raises_wire_error(header: Any, payloads: list) -> None:
    with contextlib.suppress(WireError):
        decode(with_header(header, *payloads))


def test_duplicate_filter_sequences() -> None:
    dup = DuplicateFilter()
    assert [dup.accept("a", s) for s in (0, 1, 1, 3, 2, 3, 0, -1)] == [
        True, True, False, True, True, False, False, False,
    ]  # fmt: skip
    assert dup.accept("b", 0)  # independent per request
    dup.finish("a")
    assert not dup.accept("a", 4)  # late after finish
    assert dup.is_finished("a") and dup.active == 1


def test_duplicate_filter_is_bounded() -> None:
    dup = DuplicateFilter(max_active=2, max_finished=2, max_out_of_order=3)
    for rid in ("a", "b", "c"):
        assert dup.accept(rid, 0)
    assert dup.active == 2
    assert dup.accept("a", 0)  # "a" was evicted as least recently seen
    for rid in ("x", "y", "z"):
        dup.finish(rid)
    assert not dup.accept("z", 0) and dup.accept("x", 0)  # "x" aged out of the finished LRU
    assert [dup.accept("w", s) for s in (5, 6, 7, 8)] == [True, True, True, False]
    assert dup.accept("w", 0)  # the watermark still advances
    with pytest.raises(ValueError):
        DuplicateFilter(max_active=0)
