"""Paged KV-cache bookkeeping: reference-counted blocks and hash-chained prefix caching.

Only bookkeeping lives here; the tensors are in :mod:`kv_cache`. A block is *cached* when it
is full and its content hash is registered: a later sequence whose prompt starts with the same
tokens (same chain of hashes) reuses it instead of recomputing it. Freed cached blocks stay
reusable until they are evicted, least recently freed first. ``can_*`` methods only check;
``allocate``/``free``/``cache_full_blocks`` mutate.

A sequence's ``cache_salt`` seeds its chain: the first block's parent is a key derived from
the salt instead of the root, so every key of a salted sequence differs from those of unsalted
sequences and of other salts, and only sequences with equal salts share blocks (tenants'
prompts stay apart: no reuse, so no hit to observe).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from edgeinfer.daemon.engine.errors import EngineError
from edgeinfer.daemon.engine.sequence import Sequence
from edgeinfer.shared.block_keys import block_hash, salt_key

__all__ = ["Block", "BlockManager", "block_hash", "salt_key"]

_NEVER = 1 << 62  # a registration watermark no sequence reaches


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise EngineError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_clean: deque[int] = deque(range(num_blocks))
        # Free blocks still holding a registered prefix, oldest-freed first (LRU eviction).
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[bytes, int] = {}
        # Per sequence: hashes of its leading full blocks, computed once.
        self._seq_hashes: dict[int, list[bytes]] = {}
        self._registered: dict[int, int] = {}
        # Keys registered (True) or dropped (False) since take_changes(), each with its final
        # state; None until track_changes() (nobody reads them: the daemon's kv_events).
        self._changes: dict[bytes, bool] | None = None
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ---- accounting -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that an allocation may take (free cached blocks count: they are evictable)."""
        return len(self._free_clean) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # ---- prefix cache -----------------------------------------------------------------
    def _hashes(self, seq: Sequence) -> list[bytes]:
        """Hashes of every full block of ``seq.token_ids``, extended incrementally."""
        hashes = self._seq_hashes.setdefault(id(seq), [])
        bs = self.block_size
        for i in range(len(hashes), seq.num_tokens // bs):
            parent = hashes[-1] if hashes else salt_key(seq.cache_salt)
            hashes.append(block_hash(parent, seq.token_ids[i * bs : (i + 1) * bs]))
        return hashes

    def match_prefix(self, seq: Sequence, max_tokens: int | None = None) -> list[int]:
        """Block ids of the longest cached prefix of ``seq`` (checks only, no mutation).

        At most ``max_tokens`` tokens are matched; the caller keeps at least one prompt token
        uncomputed so the model still produces logits for the next token.
        """
        if not self.enable_prefix_caching:
            return []
        limit = seq.num_tokens if max_tokens is None else max_tokens
        matched: list[int] = []
        for h in self._hashes(seq)[: limit // self.block_size]:
            block_id = self._hash_to_block.get(h)
            if block_id is None:
                break
            matched.append(block_id)
        return matched

    # ---- allocation -------------------------------------------------------------------
    def num_new_blocks(self, seq: Sequence, num_tokens: int, cached: Seq[int] = ()) -> int:
        """Blocks that must be taken from the free pool for ``seq`` to hold ``num_tokens``."""
        have = len(seq.block_table) or len(cached)
        need = self.blocks_for(num_tokens) - have
        # Reusing a cached block that is currently free also consumes a free block.
        revived = (
            sum(1 for b in cached if self.blocks[b].ref_count == 0) if not seq.block_table else 0
        )
        return max(need, 0) + revived

    def can_allocate(self, seq: Sequence, num_tokens: int, cached: Seq[int] = ()) -> bool:
        return self.num_new_blocks(seq, num_tokens, cached) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int, cached: Seq[int] = ()) -> None:
        """Grow ``seq.block_table`` to cover ``num_tokens``; ``cached`` (from
        :meth:`match_prefix`, only for a sequence without blocks) are shared, not copied."""
        if not self.can_allocate(seq, num_tokens, cached):
            raise EngineError(f"out of KV blocks for request {seq.request_id}")
        if not seq.block_table and cached:
            for block_id in cached:
                self._take(block_id)
            seq.block_table.extend(cached)
            self.prefix_hits += len(cached)
        for _ in range(self.blocks_for(num_tokens) - len(seq.block_table)):
            seq.block_table.append(self._take_free())

    def record_prefix_query(self, num_blocks: int) -> None:
        self.prefix_queries += num_blocks

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self._free_cached.pop(block_id, None)
        block.ref_count += 1

    def _take_free(self) -> int:
        if self._free_clean:
            block_id = self._free_clean.popleft()
        else:
            block_id, _ = self._free_cached.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None and self._hash_to_block.get(block.hash) == block_id:
                del self._hash_to_block[block.hash]
                if self._changes is not None:
                    self._changes[block.hash] = False
            block.hash = None
        self.blocks[block_id].ref_count = 1
        return block_id

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register every full block whose tokens are all computed, so others can reuse it."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        # Blocks below the watermark were registered (or found registered) by an earlier call.
        start = self._registered.get(id(seq), 0)
        if num_full <= start:
            return
        hashes = self._hashes(seq)
        self._registered[id(seq)] = num_full
        for i in range(start, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is not None:
                continue
            block.hash = hashes[i]
            # First writer wins; an identical block computed concurrently stays private.
            won = self._hash_to_block.setdefault(hashes[i], block.block_id) == block.block_id
            if won and self._changes is not None:
                self._changes[hashes[i]] = True

    def keep_private(self, seq: Sequence) -> None:
        """Never register ``seq``'s blocks while it holds them: their content came from a peer
        this cache does not trust (a recomputation after a preemption starts afresh)."""
        self._registered[id(seq)] = _NEVER

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks, tail first, so the shared head of a prefix outlives it."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise EngineError(f"double free of KV block {block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None and self._hash_to_block.get(block.hash) == block_id:
                    self._free_cached[block_id] = None
                else:
                    block.hash = None
                    self._free_clean.append(block_id)
        seq.block_table.clear()
        self.forget(seq)

    def forget(self, seq: Sequence) -> None:
        """Drop per-sequence hash state (the sequence ended or lost its blocks)."""
        self._seq_hashes.pop(id(seq), None)
        self._registered.pop(id(seq), None)

    def reset_prefix_cache(self) -> None:
        for block_id in list(self._free_cached):
            self.blocks[block_id].hash = None
            self._free_clean.append(block_id)
        self._free_cached.clear()
        kept = {h: b for h, b in self._hash_to_block.items() if self.blocks[b].ref_count > 0}
        if self._changes is not None:
            self._changes.update(dict.fromkeys(self._hash_to_block.keys() - kept.keys(), False))
        self._hash_to_block = kept

    # ---- change feed (the daemon publishes it to the routers' prefix index) ------------
    def track_changes(self) -> None:
        """Start recording registered and dropped keys for :meth:`take_changes`."""
        if self._changes is None:
            self._changes = {}

    def take_changes(self) -> dict[bytes, bool]:
        """Keys whose cached state changed since the last call: True cached, False gone."""
        changes = self._changes
        if not changes:
            return {}
        self._changes = {}
        return changes

    def cached_keys(self) -> list[bytes]:
        """Every key a prefix lookup can hit now."""
        return list(self._hash_to_block)
