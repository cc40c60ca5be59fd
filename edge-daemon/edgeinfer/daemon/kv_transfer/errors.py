"""Exceptions of the KV-transfer layer. Everything derives from :class:`KVTransferError`.

Wire errors carry a short, stable ``reason`` code so the daemon can count drops per reason in a
metric label without parsing messages; the message text is for logs only.
"""

from typing import ClassVar

from edgeinfer.shared.errors import EdgeInferError


class KVTransferError(EdgeInferError):
    """Base class of every error the KV-transfer layer raises on purpose."""


class WireError(KVTransferError):
    """A received (or about to be sent) message violates the wire protocol.

    ``rid`` is the request id when the header was readable far enough to know it, so the
    receiver can answer with an ``error`` message instead of letting the peer wait.
    """

    reason: ClassVar[str] = "malformed"

    def __init__(self, detail: str, *, rid: str | None = None) -> None:
        super().__init__(f"{self.reason}: {detail}")
        self.rid = rid


class MalformedError(WireError):
    """Undecodable header, missing or ill-typed field, out-of-range value."""

    reason = "malformed"


class UnknownKindError(WireError):
    """The ``kind`` field names no message type of this protocol version."""

    reason = "unknown_kind"


class BadVersionError(WireError):
    """The peer speaks another protocol version."""

    reason = "bad_version"


class SizeMismatchError(WireError):
    """Frame count or byte length disagrees with the header's ``shape``/``nbytes``/``dtype``."""

    reason = "size_mismatch"


class ChecksumError(WireError):
    """The header or a payload frame does not match its CRC-32."""

    reason = "checksum"


class TooLargeError(WireError):
    """The message exceeds a configured :class:`~.wire.WireLimits` bound."""

    reason = "too_large"


class SecurityError(KVTransferError):
    """CURVE keys are missing or unreadable, or no client key is authorised."""
