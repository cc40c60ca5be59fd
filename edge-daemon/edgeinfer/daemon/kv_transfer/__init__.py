"""Prefill -> decode KV-cache transfer: wire format, duplicate filtering, CURVE security.

The protocol itself is specified in :mod:`edgeinfer.daemon.kv_transfer.wire`.
"""

from edgeinfer.daemon.kv_transfer.dedup import DuplicateFilter
from edgeinfer.daemon.kv_transfer.errors import (
    BadVersionError,
    ChecksumError,
    KVTransferError,
    MalformedError,
    SecurityError,
    SizeMismatchError,
    TooLargeError,
    UnknownKindError,
    WireError,
)
from edgeinfer.daemon.kv_transfer.messages import (
    DTYPE_ITEMSIZE,
    PROTOCOL_VERSION,
    Abort,
    ErrorReply,
    FirstToken,
    KVChunk,
    KVPull,
    Message,
    Ping,
    Pong,
    PrefillRequest,
    WireLayout,
)
from edgeinfer.daemon.kv_transfer.wire import (
    DEFAULT_LIMITS,
    WireLimits,
    decode,
    encode,
    limit_socket,
)

__all__ = [
    "DEFAULT_LIMITS",
    "DTYPE_ITEMSIZE",
    "PROTOCOL_VERSION",
    "Abort",
    "BadVersionError",
    "ChecksumError",
    "DuplicateFilter",
    "ErrorReply",
    "FirstToken",
    "KVChunk",
    "KVPull",
    "KVTransferError",
    "MalformedError",
    "Message",
    "Ping",
    "Pong",
    "PrefillRequest",
    "SecurityError",
    "SizeMismatchError",
    "TooLargeError",
    "UnknownKindError",
    "WireError",
    "WireLayout",
    "WireLimits",
    "decode",
    "encode",
    "limit_socket",
]
