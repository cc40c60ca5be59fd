"""Heartbeat schema (version 1): what every edge daemon tells the routers about itself.

Each daemon publishes one heartbeat per interval (``heartbeat_interval_s``, default 5 s) on a
ZeroMQ PUB socket; every router SUBscribes to all daemons. A message is a single frame holding a
msgpack map with exactly these keys (more are ignored, see below):

| key | type | meaning |
|---|---|---|
| `v` | int | schema version, 1 |
| `daemon_id` | str | the daemon's HTTP base URL (`http://host:port`), its identity |
| `pop` | str | the point of presence it runs in (must match the router's PoP table) |
| `role` | str | `prefill`, `decode` or `both` |
| `model` | str | the served model name clients send |
| `kv_endpoint` | str or nil | ZeroMQ endpoint of its KV channel (prefill side), nil if none |
| `running` | int | requests in the running batch |
| `waiting` | int | requests queued for admission |
| `kv_blocks_free` | int | free KV blocks (free prefix-cached blocks count as free) |
| `kv_blocks_total` | int | KV blocks in the cache, >= `kv_blocks_free` |
| `block_size` | int | tokens per KV block, >= 1 |
| `prefill_tokens_per_s` | float | prompt tokens computed per busy second, recent window; 0 = not measured yet |
| `decode_tokens_per_s` | float | tokens generated per busy second (whole batch), recent window; 0 = not measured yet |
| `ttft_p50_s` | float or nil | median time to first token, recent window |
| `itl_p50_s` | float or nil | median inter-token latency, recent window |
| `queued_prefill_tokens` | int | prompt tokens not computed yet, over waiting and running requests |
| `draining` | bool | refuses new requests (SIGTERM or admin drain) |
| `drained` | bool | draining and nothing left in flight |
| `in_flight` | int | requests accepted and not finished |
| `seq` | int | per-process counter, +1 per heartbeat from 0 |
| `started_at` | float | unix time the process started; a restart resets `seq` |
| `sent_at` | float | unix time this heartbeat was built (for display; routers age by arrival) |

Rates are per *busy* second, not per wall second: an idle daemon is not a slow one, and the
router needs speed to predict how long a queue takes to drain.

Compatibility: a reader rejects any other `v`. Unknown keys are ignored so that a daemon may add
an optional field before every router knows it (daemons and routers upgrade independently across
hundreds of PoPs); changing the meaning or type of an existing key bumps `v`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import msgpack

from edgeinfer.shared.errors import EdgeInferError

HEARTBEAT_VERSION = 1
# Far above any real heartbeat (~600 bytes); bounds what a garbage sender can make us parse.
MAX_HEARTBEAT_BYTES = 64 * 1024
_MAX_STR = 1024
_MAX_WIRE_INT = 2**64 - 1  # msgpack's largest integer

Role = Literal["prefill", "decode", "both"]
ROLES: frozenset[str] = frozenset({"prefill", "decode", "both"})

_STR_FIELDS = ("daemon_id", "pop", "model")
_COUNT_FIELDS = (
    "running",
    "waiting",
    "kv_blocks_free",
    "kv_blocks_total",
    "queued_prefill_tokens",
    "in_flight",
    "seq",
)
_FLOAT_FIELDS = ("prefill_tokens_per_s", "decode_tokens_per_s", "started_at", "sent_at")
_OPTIONAL_FLOAT_FIELDS = ("ttft_p50_s", "itl_p50_s")
_BOOL_FIELDS = ("draining", "drained")


class HeartbeatError(EdgeInferError):
    """A heartbeat is malformed: undecodable bytes, wrong version, missing or invalid field."""


def _is_int(value: object) -> bool:
    # bool is an int subclass; a `true` where a count belongs is a producer bug, not a 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_str(name: str, value: object) -> None:
    if not isinstance(value, str) or not value or len(value) > _MAX_STR:
        raise HeartbeatError(
            f"heartbeat field {name!r} must be a non-empty string of <= {_MAX_STR}"
        )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat:
    """One heartbeat; construction validates every field, so an invalid one cannot exist."""

    v: int = HEARTBEAT_VERSION
    daemon_id: str
    pop: str
    role: Role
    model: str
    kv_endpoint: str | None
    running: int
    waiting: int
    kv_blocks_free: int
    kv_blocks_total: int
    block_size: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    ttft_p50_s: float | None
    itl_p50_s: float | None
    queued_prefill_tokens: int
    draining: bool
    drained: bool
    in_flight: int
    seq: int
    started_at: float
    sent_at: float

    def __post_init__(self) -> None:
        if not _is_int(self.v) or self.v != HEARTBEAT_VERSION:
            raise HeartbeatError(f"unsupported heartbeat version {self.v!r}")
        for name in _STR_FIELDS:
            _check_str(name, getattr(self, name))
        if not self.daemon_id.startswith(("http://", "https://")):
            raise HeartbeatError(f"heartbeat daemon_id {self.daemon_id!r} is not an http(s) URL")
        if not isinstance(self.role, str) or self.role not in ROLES:
            raise HeartbeatError(f"heartbeat role {self.role!r} not in {sorted(ROLES)}")
        if self.kv_endpoint is not None:
            _check_str("kv_endpoint", self.kv_endpoint)
        for name in _COUNT_FIELDS:
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise HeartbeatError(f"heartbeat field {name!r} must be an int >= 0, got {value!r}")
        if not _is_int(self.block_size) or self.block_size < 1:
            raise HeartbeatError(
                f"heartbeat block_size must be an int >= 1, got {self.block_size!r}"
            )
        if self.kv_blocks_free > self.kv_blocks_total:
            raise HeartbeatError("heartbeat kv_blocks_free exceeds kv_blocks_total")
        for name in _FLOAT_FIELDS + _OPTIONAL_FLOAT_FIELDS:
            value = getattr(self, name)
            if value is None and name in _OPTIONAL_FLOAT_FIELDS:
                continue
            # Producers in other languages may send 3 for 3.0; store one type either way.
            if _is_int(value) and value <= _MAX_WIRE_INT:
                value = float(value)
            if not isinstance(value, float) or not 0 <= value < math.inf:
                raise HeartbeatError(f"heartbeat field {name!r} must be a finite number >= 0")
            object.__setattr__(self, name, value)
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise HeartbeatError(f"heartbeat field {name!r} must be a bool")

    def encode(self) -> bytes:
        """The wire form: one msgpack map keyed by field name."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return msgpack.packb(fields, use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> Heartbeat:
        """Parse and validate one message; anything wrong raises :class:`HeartbeatError`."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise HeartbeatError(f"heartbeat must be bytes, got {type(data).__name__}")
        if len(data) > MAX_HEARTBEAT_BYTES:
            raise HeartbeatError(f"heartbeat of {len(data)} bytes exceeds {MAX_HEARTBEAT_BYTES}")
        try:
            obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
        # The parser's own errors (truncated, extra data, bad UTF-8, unhashable or non-string
        # map keys, nesting too deep) are all ValueError, TypeError or UnpackException.
        except (ValueError, TypeError, msgpack.UnpackException) as e:
            raise HeartbeatError(f"heartbeat is not valid msgpack: {e}") from e
        if not isinstance(obj, dict):
            raise HeartbeatError(f"heartbeat must be a map, got {type(obj).__name__}")
        if obj.get("v") != HEARTBEAT_VERSION or not _is_int(obj.get("v")):
            raise HeartbeatError(f"unsupported heartbeat version {obj.get('v')!r}")
        missing = sorted(_FIELD_NAMES - obj.keys())
        if missing:
            raise HeartbeatError(f"heartbeat misses fields {missing}")
        kwargs: dict[str, Any] = {name: obj[name] for name in _FIELD_NAMES}
        return cls(**kwargs)


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(Heartbeat))
