"""Every simulated daemon's prefix cache: LRU over blocks, and the index of who holds what.

A block is ``BLOCK_TOKENS`` prompt tokens named by its chained key (the Mooncake trace's
``hash_ids``: a key stands for the whole prefix up to it). A daemon's capacity is its KV in
tokens over the block size. A daemon caches a prompt's blocks when it has computed them
(prefill) or received them (the decode side of a transfer); a request reuses the leading run of
its keys that the daemon holds, touching them. Blocks are touched tail first, so the root of a
chain is the most recent and evicted last: the engine frees a finished request's blocks in
reverse order for the same reason (a tail without its root is useless; a root serves every
continuation).

Approximation: the cache is the whole KV pool, as if the blocks running requests hold were
cached too (the engine keeps a freed block's content until the block is reused, so at moderate
load most of the pool is cache); see docs/SIMULATION.md.

:class:`FleetCaches` keeps, beside the per-daemon LRUs, the index from key to the daemons
holding it, which the prefix-aware policies read through
:func:`edgeinfer.router.prefix_scoring.leading_hits`: an oracle of the fleet's current caches
(the real router learns them from KV events a little late).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

from edgeinfer.router.prefix_scoring import leading_hits

BLOCK_TOKENS = 512  # the Mooncake traces' block


class FleetCaches:
    def __init__(self, engines: int, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self.lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(engines)]
        self.holders: dict[int, set[int]] = {}  # key -> engines holding it

    def lookup(self, e: int, keys: Sequence[int]) -> int:
        """Leading blocks of ``keys`` engine ``e`` holds; they become its most recent."""
        lru, n = self.lru[e], 0
        for key in keys:
            if key not in lru:
                break
            n += 1
        for key in reversed(keys[:n]):
            lru.move_to_end(key)
        return n

    def insert(self, e: int, keys: Sequence[int]) -> None:
        """Engine ``e`` has computed or received ``keys``' blocks; evict its oldest if full."""
        lru, holders = self.lru[e], self.holders
        for key in reversed(keys):
            if key in lru:
                lru.move_to_end(key)
            else:
                lru[key] = None
                holders.setdefault(key, set()).add(e)
        while len(lru) > self.capacity:
            old, _ = lru.popitem(last=False)
            self._forget(old, e)

    def clear(self, e: int) -> None:
        """A failed or restarted daemon has lost its cache."""
        for key in self.lru[e]:
            self._forget(key, e)
        self.lru[e].clear()

    def hits(self, keys: Sequence[int]) -> dict[int, int]:
        """Per engine holding at least the first key, its leading hits (others absent)."""
        return leading_hits(keys, self.holders)

    def _forget(self, key: int, e: int) -> None:
        have = self.holders.get(key)
        if have is not None:
            have.discard(e)
            if not have:
                del self.holders[key]


def hit_rate_bounds(blocks: Sequence[Sequence[int]], capacity_blocks: int) -> dict[str, float]:
    """Block hit rates of the trace in arrival order with an infinite cache, and with one
    pooled LRU cache of ``capacity_blocks`` (the fleet's KV as if it were one daemon's): what no
    placement can beat, and what placement could reach if routing were free."""
    asked = sum(len(k) for k in blocks)
    if not asked:
        return {"infinite": 0.0, "pooled": 0.0}
    seen: set[int] = set()
    inf_hits = 0
    for keys in blocks:
        n = 0
        for key in keys:
            if key not in seen:
                break
            n += 1
        inf_hits += n
        seen.update(keys)
    pooled = pooled_rate_by_group(blocks, [""] * len(blocks), {"": capacity_blocks})
    return {"infinite": inf_hits / asked, "pooled": pooled}


def pooled_rate_by_group(
    blocks: Sequence[Sequence[int]], group: Sequence[str], capacity_blocks: Mapping[str, int]
) -> float:
    """Block hit rate with one pooled LRU per group (``group[i]`` names request ``i``'s, e.g. its
    region; ``capacity_blocks`` the KV each group's daemons have together): the pooled bound
    when a request is served only by its own group's daemons, as pulls between distant PoPs
    cost more than recomputing (:mod:`edgeinfer.router.kv_pull`)."""
    asked = sum(len(k) for k in blocks)
    if not asked:
        return 0.0
    pools = {g: FleetCaches(1, cap) for g, cap in capacity_blocks.items()}
    hits = 0
    for keys, g in zip(blocks, group, strict=True):
        hits += pools[g].lookup(0, keys)
        pools[g].insert(0, keys)
    return hits / asked
