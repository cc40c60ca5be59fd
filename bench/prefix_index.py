"""The router's prefix index at fleet size: memory (RSS delta) and lookup / update cost.

    .venv/bin/python bench/prefix_index.py                      # 700 daemons x 200k blocks
    .venv/bin/python bench/prefix_index.py --daemons 70 --blocks 20000

Every daemon holds ``--blocks`` random keys plus a shared 64-block "system prompt" chain (so a
lookup of that chain hits on every daemon); one daemon also holds a private 128-block chain.
Lookups ask for a 128-block prompt (2k tokens at 16 tokens a block): the private chain (one
daemon hits all, the rest miss at once), the shared chain + a new suffix (every daemon hits 64),
over every daemon and over 16 candidates (what a selector asks after pruning). Updates: a
batch of 16 stored + 16 evicted keys (one engine step), and installing a snapshot.
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from collections.abc import Callable

import numpy as np

from edgeinfer.router.prefix_index import PrefixIndex, U64Array


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def per_call(fn: Callable[[], object], min_s: float = 0.5) -> float:
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_s or n < 5:
        fn()
        n += 1
    return elapsed / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--daemons", type=int, default=700)
    ap.add_argument("--blocks", type=int, default=200_000)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 2**63, 64, dtype=np.uint64)
    private = rng.integers(0, 2**63, 128, dtype=np.uint64)
    names = [f"http://d{i}:8000" for i in range(args.daemons)]

    before = rss_bytes()
    index = PrefixIndex()
    start = time.perf_counter()
    for i, name in enumerate(names):
        own = rng.integers(0, 2**63, args.blocks - 64, dtype=np.uint64)
        parts = [own, shared] + ([private] if i == 0 else [])
        index.replace(name, np.unique(np.concatenate(parts)))
    build_s = time.perf_counter() - start
    after = rss_bytes()
    pairs = len(index)
    print(f"index: {args.daemons} daemons x {args.blocks} blocks = {pairs:,} pairs")
    print(
        f"  RSS delta {(after - before) / 2**30:.2f} GiB ({(after - before) / pairs:.1f} B/pair),"
        f" arrays {index.nbytes() / 2**30:.2f} GiB; build {build_s:.1f} s (incl. random keys)"
    )
    print(f"  peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")

    suffix = rng.integers(0, 2**63, 64, dtype=np.uint64)
    hot: U64Array = np.concatenate([shared, suffix])
    cands = names[:16]
    assert index.lookup(private) == {names[0]: 128}
    assert len(index.lookup(hot)) == args.daemons
    for label, q in (("private 128-block chain", private), ("shared 64 + new 64", hot)):
        all_s = per_call(lambda q=q: index.lookup(q))
        some_s = per_call(lambda q=q: index.lookup(q, cands))
        print(f"lookup {label}: all daemons {all_s * 1e3:.2f} ms, 16 candidates "
              f"{some_s * 1e6:.0f} us")  # fmt: skip

    stored = rng.integers(0, 2**63, (1000, 16), dtype=np.uint64)
    evicted_rows = [index._daemons[names[1]].base[i * 16 : (i + 1) * 16] for i in range(1000)]
    i = 0

    def step() -> None:
        nonlocal i
        index.apply(names[1], stored[i % 1000], evicted_rows[i % 1000])
        i += 1

    print(f"apply one step's batch (16 stored + 16 evicted): {per_call(step) * 1e6:.1f} us"
          " (merges amortised)")  # fmt: skip
    keys = np.unique(rng.integers(0, 2**63, args.blocks, dtype=np.uint64))
    print(
        f"install a {args.blocks}-key snapshot (sort + replace): "
        f"{per_call(lambda: index.replace(names[2], np.unique(keys))) * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
