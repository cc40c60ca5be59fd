"""Typed messages of the KV-transfer protocol; the wire format is specified in :mod:`.wire`.

Each message is a frozen dataclass whose ``__post_init__`` checks the invariants both sides must
respect (id ranges, layer range, payload sizes), so a sender cannot build what a receiver would
reject and a receiver gets the same checks for free when it rebuilds the message.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import zmq

from edgeinfer.daemon.kv_transfer.errors import MalformedError, SizeMismatchError
from edgeinfer.daemon.kv_transfer.fields import check_index_list

DTYPE_ITEMSIZE: Mapping[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
MAX_CACHE_SALT = 256  # characters; the daemon sends a 32-character digest


@dataclasses.dataclass(frozen=True, slots=True)
class WireLayout:
    """Wire form of the engine's ``KVLayout`` (dtype as a name: no torch on this layer)."""

    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_ITEMSIZE:
            raise MalformedError(f"layout dtype {self.dtype!r} not in {sorted(DTYPE_ITEMSIZE)}")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise MalformedError(f"layout {name} must be >= 1")


@dataclasses.dataclass(frozen=True, slots=True)
class PrefillRequest:
    KIND: ClassVar[str] = "prefill_req"
    rid: str
    seq: int
    prompt: tuple[int, ...]
    sampling: Mapping[str, Any]
    held_blocks: tuple[int, ...]
    layout: WireLayout
    # The request's prefix-cache salt: the prefill side's cache must use it too, or one
    # tenant's prompt would warm (and reveal) blocks for everyone. None: unsalted.
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if not self.prompt:
            raise MalformedError("prompt is empty")
        check_index_list("prompt", self.prompt, unique=False)
        check_index_list("held_blocks", self.held_blocks, unique=True)
        salt = self.cache_salt
        if salt is not None and not (isinstance(salt, str) and 0 < len(salt) <= MAX_CACHE_SALT):
            raise MalformedError(f"cache_salt must be a string of 1..{MAX_CACHE_SALT} characters")


@dataclasses.dataclass(frozen=True, slots=True)
class KVChunk:
    """KV of ``blocks`` for layers ``[layers[0], layers[1])``; one payload per ``shapes`` entry.

    ``payloads`` accepts any C-contiguous buffer-protocol object at run time (numpy arrays,
    ``tensor.numpy()`` views, ``zmq.Frame``); it is annotated ``memoryview`` because after
    construction it always holds flat ``uint8`` memoryviews over those buffers (on the receive
    side: over the ZeroMQ frames), never copies. For mypy pass ``array.data`` (a memoryview).
    """

    KIND: ClassVar[str] = "kv"
    rid: str
    seq: int
    layers: tuple[int, int]
    blocks: tuple[int, ...]
    dtype: str
    shapes: tuple[tuple[int, ...], ...]
    payloads: tuple[memoryview, ...]

    def __post_init__(self) -> None:
        start, stop = self.layers
        if not 0 <= start < stop:
            raise MalformedError(f"bad layer range {self.layers}")
        check_index_list("blocks", self.blocks, unique=True)
        itemsize = DTYPE_ITEMSIZE.get(self.dtype)
        if itemsize is None:
            raise MalformedError(f"dtype {self.dtype!r} not in {sorted(DTYPE_ITEMSIZE)}")
        if len(self.shapes) != len(self.payloads):
            raise SizeMismatchError(f"{len(self.shapes)} shapes for {len(self.payloads)} payloads")
        views = tuple(byte_view(p) for p in self.payloads)
        for i, (shape, view) in enumerate(zip(self.shapes, views, strict=True)):
            want = math.prod(shape) * itemsize
            if view.nbytes != want:
                raise SizeMismatchError(
                    f"payload {i} has {view.nbytes} bytes, {shape} needs {want}"
                )
        # Frozen, but normalising here means every consumer sees flat bytes views.
        object.__setattr__(self, "payloads", views)


@dataclasses.dataclass(frozen=True, slots=True)
class FirstToken:
    KIND: ClassVar[str] = "first_token"
    rid: str
    seq: int
    token: int
    logprob: float | None
    top_logprobs: tuple[tuple[int, float], ...]
    num_computed: int
    done: bool


@dataclasses.dataclass(frozen=True, slots=True)
class ErrorReply:
    KIND: ClassVar[str] = "error"
    rid: str
    seq: int
    code: str
    message: str


@dataclasses.dataclass(frozen=True, slots=True)
class Abort:
    KIND: ClassVar[str] = "abort"
    rid: str
    seq: int
    reason: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class Ping:
    KIND: ClassVar[str] = "ping"
    rid: str
    seq: int


@dataclasses.dataclass(frozen=True, slots=True)
class Pong:
    KIND: ClassVar[str] = "pong"
    rid: str
    seq: int


Message = PrefillRequest | KVChunk | FirstToken | ErrorReply | Abort | Ping | Pong
KINDS: Mapping[str, type[Message]] = {
    c.KIND: c for c in (PrefillRequest, KVChunk, FirstToken, ErrorReply, Abort, Ping, Pong)
}


def byte_view(buf: bytes | memoryview | zmq.Frame) -> memoryview:
    """A flat, zero-copy ``uint8`` view of ``buf``."""
    view = memoryview(buf)  # type: ignore[arg-type]  # zmq.Frame implements the buffer protocol
    if view.nbytes == 0:
        return memoryview(b"")  # cast() refuses views with a zero in their shape
    if not view.c_contiguous:
        raise MalformedError("payload buffer is not C-contiguous")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")
