"""What the daemon's prefix cache holds, told to the routers: numbered batches of changes.

The engine thread hands each step's changes (:meth:`BlockManager.take_changes`) to
:meth:`KvEventLog.push`, which numbers the batch and wakes the event loop; the heartbeat
publisher sends what has accumulated as one :class:`KvEvents` message (several batches merge
into one when the loop is busier than the engine). A router that misses a batch sees the gap in
``seq`` (or in the heartbeat's ``kv_event_seq``) and fetches :meth:`KvEventLog.snapshot` over
HTTP (``GET /v1/kv_snapshot``). The snapshot is taken in the engine thread, so the keys and
the ``seq`` it names are consistent: the batches up to that ``seq`` are in it, later ones not.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from edgeinfer.shared.heartbeat import KvEvents, KvSnapshot

if TYPE_CHECKING:
    from edgeinfer.daemon.engine.llm_engine import LLMEngine


class KvEventLog:
    def __init__(self, daemon_id: str, started_at: float) -> None:
        self.daemon_id = daemon_id
        self.started_at = started_at
        # Called from the engine thread after a push, so it must be thread-safe; the publisher
        # sets it to wake its sending task.
        self.on_push: Callable[[], None] = lambda: None
        self._lock = threading.Lock()
        self._pending: dict[bytes, bool] = {}  # merged unsent batches: key -> cached now
        self._first_unsent = 0
        self._seq = 0  # last batch numbered
        self.published_seq = 0  # last batch sent (the heartbeat's kv_event_seq)

    def attach(self, engine: LLMEngine) -> None:
        """Start recording the engine's cache changes (run in the engine thread)."""
        engine.block_manager.track_changes()

    def push(self, changes: dict[bytes, bool]) -> None:
        """One step's changes (engine thread)."""
        with self._lock:
            self._seq += 1
            if not self._pending:
                self._first_unsent = self._seq
            self._pending.update(changes)  # a later state of a key replaces the earlier one
        self.on_push()

    def take(self) -> KvEvents | None:
        """The unsent batches as one message, or None (event loop)."""
        with self._lock:
            if not self._pending:
                return None
            pending, self._pending = self._pending, {}
            first, last = self._first_unsent, self._seq
        return KvEvents(
            daemon_id=self.daemon_id,
            started_at=self.started_at,
            first_seq=first,
            seq=last,
            stored=b"".join(k for k, cached in pending.items() if cached),
            removed=b"".join(k for k, cached in pending.items() if not cached),
        )

    def snapshot(self, engine: LLMEngine) -> KvSnapshot:
        """Every cached key as of the last numbered batch (run in the engine thread)."""
        changes = engine.block_manager.take_changes()
        if changes:
            self.push(changes)  # numbered first, so the snapshot includes them
        with self._lock:
            seq = self._seq
        return KvSnapshot(
            daemon_id=self.daemon_id,
            started_at=self.started_at,
            seq=seq,
            block_size=engine.config.block_size,
            keys=b"".join(engine.block_manager.cached_keys()),
        )


def tokenizer_id(engine: LLMEngine) -> str:
    """Identity of how prompts become token ids: tokenizer.json and the chat template. Two
    daemons with equal ids produce equal block keys for equal requests."""
    h = hashlib.blake2b(digest_size=16)
    h.update((engine.model_dir / "tokenizer.json").read_bytes())
    h.update(repr(engine.tokenizer.chat_template).encode())
    return h.hexdigest()


def tokenizer_description(engine: LLMEngine) -> dict[str, Any]:
    """What ``GET /v1/tokenizer`` returns: everything a router needs to tokenise and hash a
    request as this engine will (see :mod:`edgeinfer.router.router_tokenizer`)."""
    tok = engine.tokenizer
    return {
        "tokenizer_id": tokenizer_id(engine),
        "tokenizer_json": (engine.model_dir / "tokenizer.json").read_text(encoding="utf-8"),
        "chat_template": tok.chat_template,
        "special_tokens": tok.special_tokens,
        "block_size": engine.config.block_size,
    }


def kv_bytes_per_token(engine: LLMEngine) -> int:
    """Bytes of K and V of every layer per token, as the KV plane moves them."""
    layout = engine.kv_layout
    return 2 * layout.num_layers * layout.page_bytes // layout.block_size
