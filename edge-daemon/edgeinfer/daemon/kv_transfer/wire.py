"""KV-transfer wire protocol, version 1 (prefill daemon <-> decode daemon over ZeroMQ).

Framing
    One message is one ZeroMQ multipart message::

        frame 0      crc32(H) as 4 bytes big-endian, then H = msgpack map (the header)
        frame 1..n   raw payload bytes, only for ``kind == "kv"`` (either direction)

    Payload frames are the KV-cache buffers themselves, sent with ``copy=False`` so no
    serialisation copy is made. Send with ``send_multipart(frames, copy=False, track=True)`` and
    do not reuse or free the source blocks until the returned tracker is done: libzmq reads the
    memory after ``send`` returns. The header CRC exists because the header carries data whose
    silent corruption is harmful (prompt token ids, block indices, sizes) and that no payload CRC
    covers.

Header fields common to every kind
    ``v`` int protocol version (1); ``rid`` str request id (may be empty only for ping/pong);
    ``kind`` str; ``seq`` int >= 0, numbered per (rid, direction) from 0 with no gaps. Prefill
    sends its ``kv_pull`` (if any) and ``kv`` messages as seq 0..n-1 and ``first_token`` last
    with seq n, so the decode side knows it holds all KV once it has accepted every seq below
    the first token's. Decode sends ``prefill_req`` as 0, then its ``kv`` or ``error`` answers
    to a ``kv_pull`` and its ``abort`` (if any) as 1, 2, ...
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
    prefill side's cache applies too (absent: unsalted); optional ``offers_pages`` bool (absent:
    false): the decode side serves ``kv_pull`` for its ``held_blocks``, which it keeps pinned
    until the transfer ends.
    ``kv_pull`` (prefill -> decode, only when ``offers_pages``): ``blocks`` [int] one ascending
    run of offered block indices the prefill side wants instead of recomputing. The decode side
    answers with ``kv`` messages (as above, numbered in its own direction after the
    ``prefill_req``), or with an ``error`` (code ``pull_refused``) after which the prefill side
    recomputes those blocks. A ``kv_pull`` counts in the prefill side's numbering: the
    ``first_token`` seq is then the number of ``kv_pull`` and ``kv`` messages before it.
    ``kv`` (prefill -> decode; decode -> prefill only to answer a ``kv_pull``): ``layers`` [start, stop) layer range; ``blocks`` [int] logical
    block indices carried; ``dtype`` one of float32 | bfloat16 | float16; ``shape`` [[int]] one
    per payload frame; ``nbytes`` [int] and ``crc`` [int] (zlib CRC-32) per payload frame. Every
    frame must satisfy len == nbytes == prod(shape) * itemsize(dtype). bfloat16 has no numpy
    dtype, so payloads are plain bytes and the daemon reinterprets them.
    ``first_token`` (prefill -> decode): ``token`` int; ``logprob`` float | nil; ``top_logprobs``
    [[token, logprob]]; ``num_computed`` prompt tokens the prefill side computed (the rest came
    from its prefix cache); ``done`` bool (the request finished at its first token).
    ``error`` (either way; decode -> prefill only to refuse a ``kv_pull``): ``code`` str,
    ``message`` str. ``abort`` (decode -> prefill):
    ``reason`` str. ``ping`` / ``pong``: pong echoes the ping's ``seq``; optional ``features``
    [str] on a pong (absent: none) lists what the answering side supports beyond the core
    (``kv_pull``).

Mixed fleets
    Every extension is optional and negotiated, so the version stays 1: a decode daemon pings
    each prefill endpoint when it connects (and again after a disconnect) and sets
    ``offers_pages`` only towards one whose pong listed ``kv_pull``; until that pong arrives, and
    towards an older prefill daemon (plain pong), it offers nothing. A prefill daemon pulls only
    when offered and answers pings (which older decode daemons never send) with ``features``.

Validation
    The header schema is the message classes of :mod:`.messages` (msgspec Structs, tagged by
    ``kind``, unknown fields forbidden), decoded in one msgspec call after the envelope
    (``v``, ``rid``, ``kind``) was checked, so errors name the request where they can.
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

import msgspec
import zmq
from isal.isal_zlib import crc32  # zlib's CRC-32, ~6x faster (ISA-L)
from msgspec import UNSET

from edgeinfer.daemon.kv_transfer.errors import (
    BadVersionError,
    ChecksumError,
    MalformedError,
    SizeMismatchError,
    TooLargeError,
    UnknownKindError,
    WireError,
)
from edgeinfer.daemon.kv_transfer.messages import (
    KINDS,
    PROTOCOL_VERSION,
    KVChunk,
    Message,
    Ping,
    Pong,
    byte_view,
)

_CRC = struct.Struct(">I")
_MAX_RID = 256
_ENCODER = msgspec.msgpack.Encoder()
_DECODERS = {kind: msgspec.msgpack.Decoder(cls) for kind, cls in KINDS.items()}


@dataclasses.dataclass(frozen=True)
class WireLimits:
    """Upper bounds a receiver enforces before trusting a message."""

    max_header_bytes: int = 4 << 20  # a 500k-token prompt as msgpack ints fits
    max_payload_frames: int = 1024
    max_message_bytes: int = 2 << 30


DEFAULT_LIMITS = WireLimits()


class _Envelope(msgspec.Struct):
    """What every header must hold, read before the kind's schema (other keys ignored)."""

    v: Any = None
    rid: Any = None
    kind: Any = None


_ENVELOPE = msgspec.msgpack.Decoder(_Envelope)


def encode(msg: Message) -> list[bytes | memoryview]:
    """Frames for ``send_multipart(..., copy=False)``; payload frames alias the source buffers."""
    payloads: tuple[memoryview, ...] = ()
    if isinstance(msg, KVChunk):
        payloads = msg.frames
        msg = msgspec.structs.replace(
            msg,
            payloads=UNSET,
            nbytes=tuple(p.nbytes for p in payloads),
            crc=tuple(crc32(p) for p in payloads),
        )
    packed = _ENCODER.encode(msg)
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
    header = head[_CRC.size :]
    cls, rid = _envelope(header)
    if not rid and cls not in (Ping, Pong):
        raise MalformedError("empty rid")
    payloads = views[1:]
    if payloads and cls is not KVChunk:
        raise SizeMismatchError(
            f"{cls.KIND} carries no payload, got {len(payloads)} frames", rid=rid
        )
    try:
        msg = _DECODERS[cls.KIND].decode(header)
        if isinstance(msg, KVChunk):
            _attach(msg, payloads)
    except msgspec.DecodeError as e:  # ValidationError included: a field's type or bound
        raise MalformedError(str(e), rid=rid or None) from None
    except WireError as e:  # a message's own checks
        e.rid = rid or None
        raise
    return msg


def limit_socket(sock: zmq.Socket[Any], limits: WireLimits = DEFAULT_LIMITS) -> None:
    """Make libzmq disconnect a peer that sends a frame larger than any valid message."""
    sock.setsockopt(zmq.MAXMSGSIZE, limits.max_message_bytes)


def _envelope(header: memoryview) -> tuple[type[Message], str]:
    try:
        env = _ENVELOPE.decode(header)
    except msgspec.DecodeError as e:
        raise MalformedError(f"undecodable header: {e}") from None
    if env.v != PROTOCOL_VERSION:
        if type(env.v) is not int or env.v < 0:
            raise MalformedError("field 'v' must be a non-negative int64")
        raise BadVersionError(f"version {env.v}, expected {PROTOCOL_VERSION}")
    rid = env.rid
    if not isinstance(rid, str) or len(rid) > _MAX_RID:
        raise MalformedError(f"field 'rid' must be a string of at most {_MAX_RID} characters")
    cls = KINDS.get(env.kind) if isinstance(env.kind, str) else None
    if cls is None:
        raise UnknownKindError(f"kind {env.kind!r}", rid=rid or None)
    return cls, rid


def _attach(msg: KVChunk, payloads: list[memoryview]) -> None:
    """Check the frames against the header's sizes and CRCs, then hand them to the chunk."""
    if msg.payloads is not UNSET:
        raise MalformedError("payloads travel as frames, not in the header")
    if msg.nbytes is UNSET or msg.crc is UNSET:
        raise MalformedError("a kv header needs nbytes and crc")
    if not len(msg.shapes) == len(msg.nbytes) == len(msg.crc) == len(payloads):
        raise SizeMismatchError("shape/nbytes/crc/frame counts differ")
    for i, (view, size, crc) in enumerate(zip(payloads, msg.nbytes, msg.crc, strict=True)):
        if view.nbytes != size:
            raise SizeMismatchError(f"payload {i} has {view.nbytes} bytes, header says {size}")
        if crc32(view) != crc:
            raise ChecksumError(f"payload {i}")
    msg.attach(payloads)
