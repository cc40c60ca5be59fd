"""Which daemons hold which prefix-cache blocks: the router's index of the daemons' KV caches.

Fed by :mod:`edgeinfer.router.kv_sync` from the daemons' snapshots and event batches; read by
placement: :meth:`PrefixIndex.lookup` takes a request's chained block keys in order and says,
per daemon, how many leading blocks it holds (the prompt tokens it would not recompute).

Size: 700 daemons x 200k blocks is 140M (key, daemon) pairs, mostly distinct (salts keep
tenants apart). A Python dict or set costs ~100 bytes per entry (14 GB), so each daemon's keys
are a sorted ``uint64`` numpy array (8 bytes per block: 1.1 GB at that size) with a Bloom
filter of 1-2 bytes per block, of the array and of the keys added since (it answers most first
probes, misses, without a numpy call or a set probe), plus two small Python sets of changes
since the array was built, merged into it once they reach 1/8 of it (a linear merge, so an
event costs O(1) amortised). Keys are truncated to their first
8 bytes: a false hit needs a 64-bit collision among a daemon's 200k keys (~1e-14 per lookup) and
would only misplace a request, never corrupt one (the daemon matches full 16-byte keys).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

from edgeinfer.shared.heartbeat import KEY_BYTES

U64Array = npt.NDArray[np.uint64]
_EMPTY: U64Array = np.zeros(0, dtype=np.uint64)
_MIN_MERGE = 1024  # changes kept as sets before a merge, however small the array


def key_array(keys: bytes | Sequence[bytes]) -> U64Array:
    """16-byte block keys (packed back to back, or a list) as the index's 64-bit keys."""
    blob = keys if isinstance(keys, bytes | bytearray | memoryview) else b"".join(keys)
    if len(blob) % KEY_BYTES:
        raise ValueError(f"{len(blob)} bytes of keys is not a multiple of {KEY_BYTES}")
    return np.frombuffer(blob, dtype="<u8")[::2].astype(np.uint64)


def sorted_keys(keys: bytes | Sequence[bytes]) -> U64Array:
    """:func:`key_array`, sorted and deduplicated (what :meth:`PrefixIndex.replace` takes;
    worth computing off the event loop for a large snapshot: numpy releases the GIL)."""
    return np.unique(key_array(keys))


def _bloom(base: U64Array) -> tuple[bytearray, int]:
    """A one-hash Bloom filter of ``base`` and its mask: bit ``key & mask`` is set for each key.
    8-16 bits a key, so 6-12% of absent keys pass (keys are hashes: their low bits are uniform);
    a miss costs a byte read instead of a numpy call (~1 us), and most daemons asked about a
    prompt miss its first block."""
    if not len(base):
        return bytearray(), 0
    bits = 1 << max(6, (8 * len(base) - 1).bit_length())
    flags = np.zeros(bits, dtype=bool)
    flags[(base & np.uint64(bits - 1)).astype(np.intp)] = True
    return bytearray(np.packbits(flags, bitorder="little").tobytes()), bits - 1


def _contains(base: U64Array, q: U64Array) -> npt.NDArray[np.bool_]:
    if not len(base):
        return np.zeros(len(q), dtype=bool)
    pos = np.searchsorted(base, q)
    pos[pos == len(base)] = 0
    return base[pos] == q


class _Holdings:
    """One daemon's cached keys: a sorted array, minus ``removed``, plus ``added``."""

    __slots__ = ("added", "base", "bloom", "mask", "removed")

    def __init__(self, base: U64Array) -> None:
        self.base = base
        # Of base, and of the keys added since (their bits set as they come): a miss is a key
        # not held. Empty with base (then added is probed as a set).
        self.bloom, self.mask = _bloom(base)
        self.added: set[int] = set()  # present, not in base
        self.removed: set[int] = set()  # in base, gone

    def __len__(self) -> int:
        return len(self.base) - len(self.removed) + len(self.added)

    def apply(self, stored: U64Array, removed: U64Array) -> None:
        for key, in_base in zip(removed.tolist(), _contains(self.base, removed).tolist()):
            if in_base:
                self.removed.add(key)
            else:
                self.added.discard(key)
        bloom, mask = self.bloom, self.mask
        for key, in_base in zip(stored.tolist(), _contains(self.base, stored).tolist()):
            if in_base:
                self.removed.discard(key)
            else:
                self.added.add(key)
                if bloom:
                    b = key & mask
                    bloom[b >> 3] |= 1 << (b & 7)
        if len(self.added) + len(self.removed) > max(_MIN_MERGE, len(self.base) // 8):
            self.merge()

    def merge(self) -> None:
        base = self.base
        if self.removed:
            drop = np.searchsorted(base, np.fromiter(self.removed, np.uint64, len(self.removed)))
            keep = np.ones(len(base), dtype=bool)
            keep[drop] = False
            base = base[keep]
        if self.added:
            added = np.fromiter(self.added, np.uint64, len(self.added))
            added.sort()
            # Two sorted runs: the stable sort (timsort) merges them in linear time.
            base = np.sort(np.concatenate((base, added)), kind="stable")
        self.base = base
        self.bloom, self.mask = _bloom(base)
        self.added.clear()
        self.removed.clear()

    def has(self, key: int, q: U64Array, i: int) -> bool:
        """Whether ``key`` (== ``q[i]``) is held: the filter, one scalar search, two set
        probes."""
        bloom = self.bloom
        if not bloom:
            return key in self.added
        b = key & self.mask
        if not bloom[b >> 3] >> (b & 7) & 1:
            return False
        base = self.base
        pos = int(base.searchsorted(q[i]))
        in_base = pos < len(base) and base.item(pos) == key
        return (in_base and key not in self.removed) or key in self.added

    def leading(self, q: U64Array, qlist: list[int]) -> int:
        """How many of ``q`` from the start are held, by binary search over the depth: a
        daemon's holdings are prefix-closed (a sequence holds its whole chain and frees it
        tail first; eviction takes the least recently freed), so ~log2(len) probes suffice
        where testing every key would cost a hot 64-block prompt 64 probes on every daemon."""
        if not self.has(qlist[0], q, 0):
            return 0  # most daemons: one probe
        n = len(qlist)
        if self.has(qlist[n - 1], q, n - 1):
            return n
        lo, hi = 1, n - 1  # q[lo - 1] held, q[hi] not
        while lo < hi:
            mid = (lo + hi) // 2
            if self.has(qlist[mid], q, mid):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def nbytes(self) -> int:
        # A set entry is ~16 bytes of table (at its fill) plus a 32-byte int object.
        return int(self.base.nbytes) + len(self.bloom) + 56 * (len(self.added) + len(self.removed))


class PrefixIndex:
    """Block key -> daemons holding it, one :class:`_Holdings` per daemon (by URL)."""

    def __init__(self) -> None:
        self._daemons: dict[str, _Holdings] = {}

    def __contains__(self, daemon: str) -> bool:
        return daemon in self._daemons

    def daemons(self) -> list[str]:
        return list(self._daemons)

    def replace(self, daemon: str, keys: U64Array) -> None:
        """Make ``keys`` (sorted, unique: :func:`sorted_keys`) all that ``daemon`` holds."""
        self._daemons[daemon] = _Holdings(keys)

    def apply(self, daemon: str, stored: U64Array, removed: U64Array) -> None:
        """Keys now cached and no longer cached (disjoint); creates the daemon if new."""
        holdings = self._daemons.get(daemon)
        if holdings is None:
            holdings = self._daemons[daemon] = _Holdings(_EMPTY)
        holdings.apply(stored, removed)

    def forget(self, daemon: str) -> None:
        self._daemons.pop(daemon, None)

    def held_by(self, daemon: str) -> int:
        holdings = self._daemons.get(daemon)
        return len(holdings) if holdings is not None else 0

    def lookup(
        self, keys: bytes | Sequence[bytes] | U64Array, daemons: Iterable[str] | None = None
    ) -> dict[str, int]:
        """Leading blocks of ``keys`` (a request's chained block keys, in order) held by each
        daemon of ``daemons`` (default: all), for those holding at least the first."""
        q = keys if isinstance(keys, np.ndarray) else key_array(keys)
        if not len(q):
            return {}
        qlist = q.tolist()
        first, q0 = qlist[0], q[0]  # one scalar for every daemon's first probe
        table = self._daemons
        names = table.keys() if daemons is None else daemons
        hits: dict[str, int] = {}
        for name in names:
            h = table.get(name)
            if h is None:
                continue
            # Most daemons miss the first block: that probe inline, as has() does it (the
            # filter first, the array only if it passes; calling has() cost a 40-daemon lookup
            # 12-20% more), the rest in leading().
            bloom = h.bloom
            if bloom:
                b = first & h.mask
                if not bloom[b >> 3] >> (b & 7) & 1:
                    continue  # held neither in base nor since (the filter covers both)
                base = h.base
                pos = base.searchsorted(q0)
                held = pos < len(base) and base.item(pos) == first and first not in h.removed
                held = held or first in h.added
            else:
                held = first in h.added
            if held:
                hits[name] = h.leading(q, qlist)
        return hits

    def __len__(self) -> int:
        """(key, daemon) pairs held."""
        return sum(len(h) for h in self._daemons.values())

    def nbytes(self) -> int:
        """Approximate memory of the index (arrays and pending change sets)."""
        return sum(h.nbytes() for h in self._daemons.values())
