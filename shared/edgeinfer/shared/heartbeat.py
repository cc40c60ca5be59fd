"""Heartbeat schema (version 2): what every edge daemon tells the routers about itself and its
prefix cache. docs/ARCHITECTURE.md ("Heartbeat schema") is the reference; each message is
defined once here as a msgspec Struct, which is its encoder, decoder and validator at once.

The heartbeat PUB socket carries two kinds of single-frame msgpack maps, told apart by their
``type`` tag (:data:`DaemonMessage`):

- ``heartbeat`` (:class:`Heartbeat`): load, identity and the invariants a router needs to price
  a placement (block size, KV bytes per token, the local-prefill threshold, the prefill chunk,
  the tokenizer's identity), one per ``heartbeat_interval_s``. Unknown keys are *ignored*: a
  daemon may add an optional field before every router knows it (daemons and routers upgrade
  independently); changing the meaning or type of an existing key bumps ``v``.
- ``kv_events`` (:class:`KvEvents`): the prefix-cache keys stored and evicted since the previous
  batch, one message per engine step that changed the cache, numbered by a per-process ``seq``
  so that a router notices a lost batch. Unknown keys are *refused*: the KV plane is exact.

:class:`KvSnapshot` (every cached key at one ``seq``) is the body of the daemon's
``GET /v1/kv_snapshot``, which a router fetches when it first hears a daemon, after a restart
and after a lost batch; it is not sent on the PUB socket (see ARCHITECTURE.md for why).

Keys are the engine's chained, salted block hashes (16 bytes), packed back to back in one
``bytes`` field: one msgpack ``bin`` instead of thousands of small ones.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import msgspec

from edgeinfer.shared.errors import EdgeInferError

HEARTBEAT_VERSION: Literal[2] = 2
# Far above any real heartbeat (~800 bytes); bounds what a garbage sender can make us parse.
MAX_HEARTBEAT_BYTES = 64 * 1024
# An event batch holds at most the blocks one step can store or evict (a few thousand).
MAX_EVENTS_BYTES = 16 * 1024 * 1024
KEY_BYTES = 16  # one block key: blake2b-128 (engine.block_manager.block_hash)

Role = Literal["prefill", "decode", "both"]
ROLES: frozenset[str] = frozenset({"prefill", "decode", "both"})

Name = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
Url = Annotated[str, msgspec.Meta(pattern=r"^https?://", max_length=1024)]
Count = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
Seconds = Annotated[float, msgspec.Meta(ge=0)]


class HeartbeatError(EdgeInferError):
    """A daemon message is malformed: undecodable bytes, wrong version, missing or bad field."""


class HeartbeatVersionError(HeartbeatError):
    """A well-formed message of another schema version (a daemon not upgraded)."""


def _check_finite(obj: msgspec.Struct, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and not math.isfinite(value):
            raise ValueError(f"field {name!r} must be finite")


def _check_keys(name: str, blob: bytes) -> None:
    if len(blob) % KEY_BYTES:
        raise ValueError(f"{name} holds {len(blob)} bytes, not a multiple of {KEY_BYTES}")


class Heartbeat(msgspec.Struct, frozen=True, kw_only=True, tag="heartbeat", tag_field="type"):
    """One heartbeat; decoding validates every field, so an invalid one cannot exist."""

    v: Literal[2] = HEARTBEAT_VERSION
    daemon_id: Url  # the daemon's HTTP base URL, its identity
    pop: Name
    role: Role
    model: Name  # the served model name clients send
    kv_endpoint: Name | None
    running: Count
    waiting: Count
    kv_blocks_free: Count
    kv_blocks_total: Count
    block_size: Positive
    prefill_tokens_per_s: Seconds
    decode_tokens_per_s: Seconds
    ttft_p50_s: Seconds | None
    itl_p50_s: Seconds | None
    queued_prefill_tokens: Count
    draining: bool
    drained: bool
    in_flight: Count
    # Invariants of the served model and engine (constant for a process): the router prices
    # placements with each daemon's own figures instead of hand-synced copies in its config.
    kv_bytes_per_token: Positive  # K and V of every layer, as the KV plane moves them
    local_prefill_threshold: Count  # prompts up to this many tokens never leave a decode daemon
    prefill_chunk_tokens: Positive  # max_num_batched_tokens: the largest prompt chunk per step
    tokenizer_id: Name  # hash of tokenizer.json + chat template: equal ids tokenise alike
    prefix_caching: bool  # publishes kv_events (false: no cache, so never a prefix hit)
    kv_event_seq: Count  # seq of the last kv_events batch published before this heartbeat
    seq: Count  # per-process counter, +1 per heartbeat from 0
    started_at: Seconds  # unix time the process started; a restart resets both seqs
    sent_at: Seconds

    def __post_init__(self) -> None:
        _check_finite(self, ("prefill_tokens_per_s", "decode_tokens_per_s", "started_at",
                             "sent_at", "ttft_p50_s", "itl_p50_s"))  # fmt: skip
        if self.kv_blocks_free > self.kv_blocks_total:
            raise ValueError("kv_blocks_free exceeds kv_blocks_total")

    def encode(self) -> bytes:
        return _ENCODER.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> Heartbeat:
        msg = decode_message(data)
        if not isinstance(msg, Heartbeat):
            raise HeartbeatError(f"expected a heartbeat, got {type(msg).__name__}")
        return msg


class KvEvents(
    msgspec.Struct, frozen=True, kw_only=True, tag="kv_events", tag_field="type",
    forbid_unknown_fields=True,
):  # fmt: skip
    """Prefix-cache keys stored and evicted in batches ``first_seq..seq`` (consecutive batches
    may be merged into one message). Each key appears in at most one of the two lists, with its
    final state after the last batch, so applying a message twice or over a snapshot that
    already includes it is harmless."""

    daemon_id: Url
    started_at: Seconds
    first_seq: Positive
    seq: Positive
    stored: bytes = b""  # keys now cached, KEY_BYTES each
    removed: bytes = b""  # keys no longer cached

    def __post_init__(self) -> None:
        _check_finite(self, ("started_at",))
        if self.first_seq > self.seq:
            raise ValueError("first_seq exceeds seq")
        _check_keys("stored", self.stored)
        _check_keys("removed", self.removed)

    def encode(self) -> bytes:
        return _ENCODER.encode(self)


class KvSnapshot(
    msgspec.Struct, frozen=True, kw_only=True, tag="kv_snapshot", tag_field="type",
    forbid_unknown_fields=True,
):  # fmt: skip
    """Every key in a daemon's prefix cache as of kv_events batch ``seq`` (0: before any)."""

    daemon_id: Url
    started_at: Seconds
    seq: Count
    block_size: Positive
    keys: bytes

    def __post_init__(self) -> None:
        _check_finite(self, ("started_at",))
        _check_keys("keys", self.keys)

    def encode(self) -> bytes:
        return _ENCODER.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> KvSnapshot:
        try:
            return _SNAPSHOT_DECODER.decode(data)
        except msgspec.DecodeError as e:
            raise HeartbeatError(f"bad kv snapshot: {e}") from e


DaemonMessage = Heartbeat | KvEvents


class _Versioned(msgspec.Struct):
    v: object = None


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(DaemonMessage)
_SNAPSHOT_DECODER = msgspec.msgpack.Decoder(KvSnapshot)
_VERSION_DECODER = msgspec.msgpack.Decoder(_Versioned)


def decode_message(data: bytes) -> DaemonMessage:
    """Parse and validate one frame of the heartbeat socket; anything wrong raises
    :class:`HeartbeatError` (a version-1 heartbeat says so, for the operator's log)."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise HeartbeatError(f"message must be bytes, got {type(data).__name__}")
    if len(data) > MAX_EVENTS_BYTES:
        raise HeartbeatError(f"message of {len(data)} bytes exceeds {MAX_EVENTS_BYTES}")
    try:
        msg = _DECODER.decode(data)
    except msgspec.DecodeError as e:
        try:
            version = _VERSION_DECODER.decode(data).v
        except msgspec.DecodeError:
            version = None
        if version is not None and version != HEARTBEAT_VERSION:
            raise HeartbeatVersionError(f"unsupported heartbeat version {version!r}") from e
        raise HeartbeatError(f"bad daemon message: {e}") from e
    if isinstance(msg, Heartbeat) and len(data) > MAX_HEARTBEAT_BYTES:
        raise HeartbeatError(f"heartbeat of {len(data)} bytes exceeds {MAX_HEARTBEAT_BYTES}")
    return msg
