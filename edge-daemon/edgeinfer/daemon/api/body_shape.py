"""A large request body's shape: its JSON with every long value replaced by a marker.

Decoding a 16 MiB JSON body holds the GIL for ~10 ms, during which the event loop writes no
token and the engine thread runs no Python. :mod:`~edgeinfer.daemon.api.body_decoder` decodes
large bodies in another process instead, and that process sends back only the body's shape:
small, so reading it costs the daemon next to nothing. Each long string (a prompt, a message's
content) and each long list of integers (a prompt of token ids) becomes a marker string, and
:class:`Long` says how long the value was. That is enough to refuse an over-long prompt from
its length (:func:`~edgeinfer.daemon.api.early_refusal.refusal`) without the daemon ever
decoding it; a body that might be served is decoded again in the daemon, in full.

Markers carry a random nonce per body, so no string a client sends can pass for one. This
module imports nothing but msgspec: the worker process loads it alone.
"""

from __future__ import annotations

import secrets
from typing import Any

import msgspec

# Values at least this long are replaced: short enough that the shape of a prompt-sized body
# is small, long enough that ordinary fields (a model name, a stop string) stay as they are.
LONG_TEXT_CHARS = 1024
LONG_LIST_ITEMS = 1024
# A shape larger than this (a body made of many short values) is not sent back: the daemon
# decodes that body itself, as it would without the worker.
MAX_SHAPE_BYTES = 1 << 20


class Long(msgspec.Struct, frozen=True):
    """What a marker stands for: ``chars`` and ``stripped`` (without surrounding whitespace)
    for a string; ``items`` for a list of integers (``chars`` and ``stripped`` then 0)."""

    chars: int = 0
    stripped: int = 0
    items: int = 0

    @property
    def is_ids(self) -> bool:
        return self.items > 0


class Shape(msgspec.Struct, frozen=True):
    """The worker's answer. ``error``: the body is not a JSON object (the message says why).
    ``body`` None and no error: the shape would be too large to send (decode it in full).
    ``long`` empty: ``body`` is the whole body, nothing replaced."""

    body: dict[str, Any] | None = None
    long: dict[str, Long] = {}
    error: str | None = None


# The daemon's answers to a body that is no JSON object (request_body.load_json says the same).
NOT_JSON = "the request body is not valid JSON: {}"
NOT_AN_OBJECT = "the request body must be a JSON object"

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Shape)


def shape_of(raw: bytes | bytearray | memoryview) -> Shape:
    """The shape of a JSON request body (decoded with the daemon's own parser and messages)."""
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        return Shape(error=NOT_JSON.format(exc))
    if not isinstance(body, dict):
        return Shape(error=NOT_AN_OBJECT)
    long: dict[str, Long] = {}
    nonce = secrets.token_hex(8)

    def marker(value: Long) -> str:
        key = f"\u2063edgeinfer-long-{nonce}-{len(long)}\u2063"
        long[key] = value
        return key

    def walk(x: Any) -> Any:
        if isinstance(x, str):
            if len(x) < LONG_TEXT_CHARS:
                return x
            return marker(Long(chars=len(x), stripped=len(x.strip())))
        if isinstance(x, list):
            if len(x) >= LONG_LIST_ITEMS and all(type(t) is int for t in x):
                return marker(Long(items=len(x)))
            return [walk(v) for v in x]
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        return x

    return Shape(body=walk(body), long=long)


def encode_shape(shape: Shape) -> bytes:
    """``shape`` for the pipe; a too large or unencodable one (an integer beyond 64 bits) as
    the empty shape, which makes the daemon decode the body itself."""
    try:
        data = _ENCODER.encode(shape)
    except (OverflowError, msgspec.EncodeError):
        return _ENCODER.encode(Shape())
    return data if len(data) <= MAX_SHAPE_BYTES else _ENCODER.encode(Shape())


def decode_shape(data: bytes) -> Shape:
    return _DECODER.decode(data)
