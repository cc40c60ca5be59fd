"""The messages of the KV-transfer protocol, each defined once; the framing is in :mod:`.wire`.

Each message is a frozen msgspec Struct: its fields, their types and bounds *are* the header
schema (tagged by ``kind``, unknown fields forbidden), so :mod:`.wire` encodes and decodes a
header in one msgspec call, and ``__post_init__`` checks what a type cannot say (id lists
without repeats, a layer range, payload sizes) for senders and receivers alike: a sender cannot
build what a receiver would reject.

Fields added to version 1 later (``cache_salt``, ``offers_pages``, ``features``) default to
``UNSET`` and are then left out of the header, so a message that does not use them is byte for
byte what older peers read; building one with ``None`` / ``False`` / ``()`` means the same.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, ClassVar, Final, Literal

import msgspec
import zmq
from msgspec import UNSET, Meta, Struct, UnsetType
from msgspec.structs import force_setattr

from edgeinfer.daemon.kv_transfer.errors import MalformedError, SizeMismatchError

PROTOCOL_VERSION: Final = 1
DTYPE_ITEMSIZE: Mapping[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
MAX_CACHE_SALT = 256  # characters; the daemon sends a 32-character digest
MAX_INT = (1 << 63) - 1  # every wire id, size and CRC is a non-negative int64
FEATURE_KV_PULL = "kv_pull"  # a pong's feature: this prefill side pulls offered pages

UInt = Annotated[int, Meta(ge=0, le=MAX_INT)]
Rid = Annotated[str, Meta(max_length=256)]
Text = Annotated[str, Meta(max_length=4096)]
Salt = Annotated[str, Meta(min_length=1, max_length=MAX_CACHE_SALT)]
Scalar = None | bool | int | float | str
# The sampling parameters: scalars, lists of scalars, or maps of str -> scalar.
Sampling = Annotated[dict[str, Scalar | list[Scalar] | dict[str, Scalar]], Meta(max_length=256)]


class _Versioned(Struct, frozen=True, forbid_unknown_fields=True, tag_field="kind", kw_only=True):
    # Keyword-only, so it follows every message's own fields; always on the wire.
    v: Literal[1] = PROTOCOL_VERSION


class _Message(_Versioned, frozen=True):
    """Header fields of every kind: request id (empty only for ping/pong) and ``seq``."""

    rid: Rid
    seq: UInt


class WireLayout(Struct, frozen=True, forbid_unknown_fields=True):
    """Wire form of the engine's ``KVLayout`` (dtype as a name: no torch on this layer)."""

    dtype: str
    block_size: UInt
    num_layers: UInt
    num_kv_heads: UInt
    head_dim: UInt

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_ITEMSIZE:
            raise MalformedError(f"layout dtype {self.dtype!r} not in {sorted(DTYPE_ITEMSIZE)}")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise MalformedError(f"layout {name} must be >= 1")


class PrefillRequest(_Message, frozen=True, tag="prefill_req"):
    KIND: ClassVar[str] = "prefill_req"
    prompt: tuple[UInt, ...]
    sampling: Sampling
    held_blocks: tuple[UInt, ...]
    layout: WireLayout
    # The request's prefix-cache salt: the prefill side's cache must use it too, or one
    # tenant's prompt would warm (and reveal) blocks for everyone. Unset: unsalted.
    cache_salt: Salt | UnsetType = UNSET
    # The decode side serves ``kv_pull`` for ``held_blocks`` (pinned until the transfer ends).
    # Sent only to a peer whose pong listed ``kv_pull``: an older one rejects the field.
    offers_pages: bool | UnsetType = UNSET

    def __post_init__(self) -> None:
        if not self.prompt:
            raise MalformedError("prompt is empty")
        check_index_list("prompt", self.prompt, unique=False)
        check_index_list("held_blocks", self.held_blocks, unique=True)
        salt = self.cache_salt
        if salt is not UNSET and not (isinstance(salt, str) and 0 < len(salt) <= MAX_CACHE_SALT):
            raise MalformedError(f"cache_salt must be a string of 1..{MAX_CACHE_SALT} characters")
        if self.offers_pages is False:
            force_setattr(self, "offers_pages", UNSET)

    @property
    def salt(self) -> str | None:
        """``cache_salt`` as the engine takes it (None: unsalted)."""
        return self.cache_salt or None


class KVChunk(_Message, frozen=True, tag="kv"):
    """KV of ``blocks`` for layers ``[layers[0], layers[1])``; one payload per ``shapes`` entry.

    ``payloads`` accepts any C-contiguous buffer-protocol object at run time (numpy arrays,
    ``tensor.numpy()`` views, ``zmq.Frame``); it is annotated ``memoryview`` because after
    construction it always holds flat ``uint8`` memoryviews over those buffers (on the receive
    side: over the ZeroMQ frames), never copies. For mypy pass ``array.data`` (a memoryview).
    The payloads travel as frames after the header, never in it: the header carries their
    ``nbytes`` and ``crc``, which :mod:`.wire` fills in.
    """

    KIND: ClassVar[str] = "kv"
    layers: tuple[UInt, UInt]
    blocks: tuple[UInt, ...]
    dtype: str
    shapes: tuple[Annotated[tuple[UInt, ...], Meta(max_length=8)], ...] = msgspec.field(
        name="shape"
    )
    payloads: tuple[memoryview, ...] | UnsetType = UNSET
    nbytes: tuple[UInt, ...] | UnsetType = UNSET
    crc: tuple[UInt, ...] | UnsetType = UNSET

    def __post_init__(self) -> None:
        start, stop = self.layers
        if not 0 <= start < stop:
            raise MalformedError(f"bad layer range {self.layers}")
        check_index_list("blocks", self.blocks, unique=True)
        if self.dtype not in DTYPE_ITEMSIZE:
            raise MalformedError(f"dtype {self.dtype!r} not in {sorted(DTYPE_ITEMSIZE)}")
        if self.payloads is not UNSET:
            self.attach(self.payloads)

    def attach(self, payloads: Iterable[Any]) -> None:
        """Set the payloads (flat byte views, no copy) after checking them against
        ``shapes``; :mod:`.wire` calls it with the received frames."""
        views = tuple(byte_view(p) for p in payloads)
        if len(self.shapes) != len(views):
            raise SizeMismatchError(f"{len(self.shapes)} shapes for {len(views)} payloads")
        itemsize = DTYPE_ITEMSIZE[self.dtype]
        for i, (shape, view) in enumerate(zip(self.shapes, views, strict=True)):
            want = math.prod(shape) * itemsize
            if view.nbytes != want:
                raise SizeMismatchError(
                    f"payload {i} has {view.nbytes} bytes, {shape} needs {want}"
                )
        # Frozen, but normalising here means every consumer sees flat bytes views.
        force_setattr(self, "payloads", views)

    @property
    def frames(self) -> tuple[memoryview, ...]:
        """The payloads (empty for a chunk decoded without them, which :mod:`.wire` never
        hands out)."""
        return self.payloads if self.payloads is not UNSET else ()


class KVPull(_Message, frozen=True, tag="kv_pull"):
    """Prefill -> decode: send the pages of ``blocks`` (one ascending run of offered blocks)."""

    KIND: ClassVar[str] = "kv_pull"
    blocks: tuple[UInt, ...]

    def __post_init__(self) -> None:
        if not self.blocks:
            raise MalformedError("kv_pull names no block")
        check_index_list("blocks", self.blocks, unique=True)


class FirstToken(_Message, frozen=True, tag="first_token"):
    KIND: ClassVar[str] = "first_token"
    token: UInt
    logprob: float | None
    top_logprobs: tuple[tuple[UInt, float], ...]
    num_computed: UInt
    done: bool


class ErrorReply(_Message, frozen=True, tag="error"):
    KIND: ClassVar[str] = "error"
    code: Text
    message: Text


class Abort(_Message, frozen=True, tag="abort"):
    KIND: ClassVar[str] = "abort"
    reason: Text = ""


class Ping(_Message, frozen=True, tag="ping"):
    KIND: ClassVar[str] = "ping"


class Pong(_Message, frozen=True, tag="pong"):
    KIND: ClassVar[str] = "pong"
    # What the answering side supports beyond version 1's core (``kv_pull``); only sent in
    # answer to a ping, which older decode daemons never send.
    features: Annotated[tuple[Rid, ...], Meta(max_length=64)] | UnsetType = UNSET

    def __post_init__(self) -> None:
        if self.features == ():
            force_setattr(self, "features", UNSET)
        elif self.features is not UNSET and (
            len(self.features) > 64 or not all(isinstance(f, str) for f in self.features)
        ):
            raise MalformedError("features must be at most 64 strings")

    @property
    def feature_set(self) -> frozenset[str]:
        return frozenset(self.features or ())


Message = PrefillRequest | KVChunk | KVPull | FirstToken | ErrorReply | Abort | Ping | Pong
KINDS: Mapping[str, type[Message]] = {
    c.KIND: c for c in (PrefillRequest, KVChunk, KVPull, FirstToken, ErrorReply, Abort, Ping, Pong)
}


def check_index_list(name: str, values: Iterable[int], *, unique: bool) -> None:
    """Validate ids built by a sender (a receiver's decoder already checked their types)."""
    seen: set[int] = set()
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_INT:
            raise MalformedError(f"{name} holds {v!r}, not a non-negative int64")
        if unique and v in seen:
            raise MalformedError(f"{name} repeats {v}")
        seen.add(v)


def byte_view(buf: bytes | memoryview | zmq.Frame) -> memoryview:
    """A flat, zero-copy ``uint8`` view of ``buf``."""
    view = memoryview(buf)  # type: ignore[arg-type]  # zmq.Frame implements the buffer protocol
    if view.nbytes == 0:
        return memoryview(b"")  # cast() refuses views with a zero in their shape
    if not view.c_contiguous:
        raise MalformedError("payload buffer is not C-contiguous")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")
