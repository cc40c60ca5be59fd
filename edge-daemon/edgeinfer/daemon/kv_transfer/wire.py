"""KV-transfer wire protocol, version 1 (prefill daemon <-> decode daemon over ZeroMQ).

Framing
    One message is one ZeroMQ multipart message::

        frame 0      crc32(H) as 4 bytes big-endian, then H = msgpack map (the header)
        frame 1..n   raw payload bytes, only for ``kind == "kv"``

    Payload frames are the KV-cache buffers themselves, sent with ``copy=False`` so no
    serialisation copy is made. Send with ``send_multipart(frames, copy=False, track=True)`` and
    do not reuse or free the source blocks until the returned tracker is done: libzmq reads the
    memory after ``send`` returns. The header CRC exists because the header carries data whose
    silent corruption is harmful (prompt token ids, block indices, sizes) and that no payload CRC
    covers.

Header fields common to every kind
    ``v`` int protocol version (1); ``rid`` str request id (may be empty only for ping/pong);
    ``kind`` str; ``seq`` int >= 0, numbered per (rid, direction) from 0 with no gaps. Prefill
    sends its ``kv`` messages as seq 0..n-1 and ``first_token`` last with seq n, so the decode
    side knows it holds all KV once it has accepted every seq below the first token's.
    Unknown header keys are rejected, so no peer misreads a field it does not know: changing
    a field needs a version bump. An optional field added later (``cache_salt``) is left out
    of every message that does not need it, so an older peer refuses (with an ``error``
    reply naming the field) only the messages that carry it.

Kinds and their extra fields
    ``prefill_req`` (decode -> prefill): ``prompt`` [int] token ids; ``sampling`` map of
    str -> scalar / list / map (the sampling parameters); ``held_blocks`` [int] logical block
    indices the decode side already holds (prefix-cache hits), which prefill need not send;
    ``layout`` {dtype, block_size, num_layers, num_kv_heads, head_dim} of the decode side's cache;
    optional ``cache_salt`` str of 1..256 characters, the request's prefix-cache salt, which the
    prefill side's cache applies too (absent: unsalted).
    ``kv`` (prefill -> decode): ``layers`` [start, stop) layer range; ``blocks`` [int] logical
    block indices carried; ``dtype`` one of float32 | bfloat16 | float16; ``shape`` [[int]] one
    per payload frame; ``nbytes`` [int] and ``crc`` [int] (zlib CRC-32) per payload frame. Every
    frame must satisfy len == nbytes == prod(shape) * itemsize(dtype). bfloat16 has no numpy
    dtype, so payloads are plain bytes and the daemon reinterprets them.
    ``first_token`` (prefill -> decode): ``token`` int; ``logprob`` float | nil; ``top_logprobs``
    [[token, logprob]]; ``num_computed`` prompt tokens the prefill side computed (the rest came
    from its prefix cache); ``done`` bool (the request finished at its first token).
    ``error`` (either way): ``code`` str, ``message`` str. ``abort`` (decode -> prefill):
    ``reason`` str. ``ping`` / ``pong``: no extra field; pong echoes the ping's ``seq``.

Validation
    :func:`decode` checks everything above plus :class:`WireLimits` and raises a
    :class:`~.errors.WireError` subclass with a ``reason`` code on any violation, so a receiver can
    count and drop without crashing. Set ``zmq.MAXMSGSIZE`` (:func:`limit_socket`) so libzmq drops
    an oversized frame before allocating it.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Sequence
from typing import Any

import msgpack
import zmq
from isal.isal_zlib import crc32  # zlib's CRC-32, ~6x faster (ISA-L)

from edgeinfer.daemon.kv_transfer.errors import (
    BadVersionError,
    ChecksumError,
    MalformedError,
    SizeMismatchError,
    TooLargeError,
    UnknownKindError,
    WireError,
)
from edgeinfer.daemon.kv_transfer.fields import HeaderReader
from edgeinfer.daemon.kv_transfer.messages import (
    KINDS,
    Abort,
    ErrorReply,
    FirstToken,
    KVChunk,
    Message,
    Ping,
    Pong,
    PrefillRequest,
    WireLayout,
    byte_view,
)

PROTOCOL_VERSION = 1
_CRC = struct.Struct(">I")


@dataclasses.dataclass(frozen=True)
class WireLimits:
    """Upper bounds a receiver enforces before trusting a message."""

    max_header_bytes: int = 4 << 20  # a 500k-token prompt as msgpack ints fits
    max_payload_frames: int = 1024
    max_message_bytes: int = 2 << 30


DEFAULT_LIMITS = WireLimits()


def encode(msg: Message) -> list[bytes | memoryview]:
    """Frames for ``send_multipart(..., copy=False)``; payload frames alias the source buffers."""
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "rid": msg.rid, "kind": msg.KIND}
    header.update((f.name, getattr(msg, f.name)) for f in dataclasses.fields(msg))
    payloads: list[memoryview] = []
    if isinstance(msg, KVChunk):
        payloads = list(msg.payloads)
        del header["payloads"], header["shapes"]
        header["shape"] = msg.shapes
        header["nbytes"] = [p.nbytes for p in payloads]
        header["crc"] = [crc32(p) for p in payloads]
    elif isinstance(msg, PrefillRequest):
        header["layout"] = dataclasses.asdict(msg.layout)
        header["sampling"] = dict(msg.sampling)
        if msg.cache_salt is None:
            del header["cache_salt"]  # an unsalted request stays readable by older peers
    packed = msgpack.packb(header, use_bin_type=True)
    return [_CRC.pack(crc32(packed)) + packed, *payloads]


def decode(
    frames: Sequence[bytes | memoryview | zmq.Frame], *, limits: WireLimits = DEFAULT_LIMITS
) -> Message:
    """Parse and fully validate one multipart message; raise a WireError subclass if invalid."""
    if not frames:
        raise MalformedError("empty message")
    if len(frames) - 1 > limits.max_payload_frames:
        raise TooLargeError(f"{len(frames) - 1} payload frames > {limits.max_payload_frames}")
    views = [byte_view(f) for f in frames]
    total = sum(v.nbytes for v in views)
    if total > limits.max_message_bytes:
        raise TooLargeError(f"{total} bytes > {limits.max_message_bytes}")
    head = views[0]
    if head.nbytes > limits.max_header_bytes + _CRC.size:
        raise TooLargeError(f"header of {head.nbytes} bytes > {limits.max_header_bytes}")
    if head.nbytes <= _CRC.size:
        raise MalformedError("header frame too short")
    if _CRC.unpack(head[: _CRC.size])[0] != crc32(head[_CRC.size :]):
        raise ChecksumError("header")
    try:
        header = msgpack.unpackb(head[_CRC.size :], raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise MalformedError(f"undecodable header: {e}") from None
    reader = HeaderReader(header)
    version = reader.uint("v")
    if version != PROTOCOL_VERSION:
        raise BadVersionError(f"version {version}, expected {PROTOCOL_VERSION}")
    rid = reader.text("rid")
    try:
        return _decode_body(reader, rid, views[1:])
    except WireError as e:
        e.rid = rid or None
        raise


def limit_socket(sock: zmq.Socket[Any], limits: WireLimits = DEFAULT_LIMITS) -> None:
    """Make libzmq disconnect a peer that sends a frame larger than any valid message."""
    sock.setsockopt(zmq.MAXMSGSIZE, limits.max_message_bytes)


def _decode_body(reader: HeaderReader, rid: str, payloads: list[memoryview]) -> Message:
    kind = reader.text("kind")
    cls = KINDS.get(kind)
    if cls is None:
        raise UnknownKindError(f"kind {kind!r}")
    if not rid and cls not in (Ping, Pong):
        raise MalformedError("empty rid")
    if payloads and cls is not KVChunk:
        raise SizeMismatchError(f"{kind} carries no payload, got {len(payloads)} frames")
    seq = reader.uint("seq")
    msg: Message
    if cls is KVChunk:
        layers = reader.uint_list("layers")
        if len(layers) != 2:
            raise MalformedError("layers must be [start, stop]")
        shapes = reader.list_of("shape", lambda k, v: tuple(reader.as_uint_list(k, v, 8)))
        nbytes = reader.uint_list("nbytes")
        crcs = reader.uint_list("crc")
        if not len(shapes) == len(nbytes) == len(crcs) == len(payloads):
            raise SizeMismatchError("shape/nbytes/crc/frame counts differ")
        for i, (view, size, crc) in enumerate(zip(payloads, nbytes, crcs, strict=True)):
            if view.nbytes != size:
                raise SizeMismatchError(f"payload {i} has {view.nbytes} bytes, header says {size}")
            if crc32(view) != crc:
                raise ChecksumError(f"payload {i}")
        msg = KVChunk(
            rid,
            seq,
            (layers[0], layers[1]),
            tuple(reader.uint_list("blocks")),
            reader.text("dtype"),
            tuple(shapes),
            tuple(payloads),
        )
    elif cls is PrefillRequest:
        layout = reader.submap("layout")
        msg = PrefillRequest(
            rid,
            seq,
            tuple(reader.uint_list("prompt")),
            reader.sampling("sampling"),
            tuple(reader.uint_list("held_blocks")),
            WireLayout(
                layout.text("dtype"),
                layout.uint("block_size"),
                layout.uint("num_layers"),
                layout.uint("num_kv_heads"),
                layout.uint("head_dim"),
            ),
            reader.opt_text("cache_salt"),
        )
        layout.finish()
    elif cls is FirstToken:
        top = reader.list_of("top_logprobs", reader.as_logprob_pair)
        msg = FirstToken(
            rid,
            seq,
            reader.uint("token"),
            reader.opt_float("logprob"),
            tuple(top),
            reader.uint("num_computed"),
            reader.flag("done"),
        )
    elif cls is ErrorReply:
        msg = ErrorReply(rid, seq, reader.text("code"), reader.text("message"))
    elif cls is Abort:
        msg = Abort(rid, seq, reader.text("reason"))
    elif cls is Ping:
        msg = Ping(rid, seq)
    elif cls is Pong:
        msg = Pong(rid, seq)
    else:
        raise UnknownKindError(f"kind {kind!r} has no decoder")
    reader.finish()
    return msg
