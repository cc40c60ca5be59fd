"""Cost-based grouping of a step's decode sequences for the CPU attention kernel.

:func:`~edgeinfer.kernels.paged_attention_cpu.paged_decode_attention_cpu` attends each
:class:`DecodeGroup` with one gather and one ``scaled_dot_product_attention``, every row of a
group padded to the group's longest context. A group therefore costs a fixed amount per call
(dispatch, mask handling, allocation: ~25 us on 2 EPYC cores whatever the size) plus an amount
per padded key that grows with the key's width (the K/V bytes gathered and multiplied). The
kernel's own plan splits on fixed rules (at most 2048 keys, rows at least half the longest),
blind to both costs. Here the split minimises the modelled cost exactly: a dynamic programme
over the length-sorted rows (groups are contiguous runs), with each group's gathered K/V
capped in bytes so it stays in a core's L2 cache: measured, a key read from L3 or DRAM costs
2-3x one read from L2, which outweighs the calls that bigger groups save.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

from edgeinfer.kernels.paged_attention_cpu import DecodeGroup, DecodePlan

# Modelled cost in nanoseconds, measured on 2 AMD EPYC cores with torch 2.13 for groups of
# 1-64 rows of 16-1024 keys: a call, and a padded key of ``key_bytes`` (K plus V) bytes.
CALL_NS = 25_000.0
KEY_NS = 20.0
KEY_BYTE_NS = 0.045
# The most K+V bytes one group gathers: half of a 1 MiB L2 (2048 keys of 2 x 16 fp32 heads).
GROUP_BYTES = 512 << 10


# From this many K+V bytes per cached token (float32), decode attention skips the plan for
# numba's kernel, which reads each key where it lies instead of gathering a padded copy: on 2
# EPYC cores 0.5-0.8x the torch path's time on SmolLM2's 3 x 64 heads (1.5 KiB) at batch 1-32,
# while on narrow heads (the tiny preset's 2 x 16, 256 B) torch's two threads win by ~15%.
IN_PLACE_MIN_KEY_BYTES = 1024


def decode_in_place(dtype: torch.dtype, key_bytes: int) -> bool:
    """Whether CPU decode attention of this cache runs in place (see above) or on a plan."""
    return dtype == torch.float32 and key_bytes >= IN_PLACE_MIN_KEY_BYTES


def int_tensor(values: array, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor over ``values`` (typecode matching ``dtype``), without copying: several
    times faster than ``torch.tensor`` of a list of Python ints, which checks every element."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(values, dtype=dtype)


def plan_decode(
    block_tables: Sequence[Sequence[int]],  # [B][>= cdiv(len, page)] block ids per sequence
    context_lens: Sequence[int],  # [B], >= 1 each
    page: int,
    key_bytes: int,  # K plus V bytes of one cached token in one layer
) -> DecodePlan:
    """The cheapest grouping under the cost model, for ``paged_decode_attention_cpu``."""
    lens = list(context_lens)
    batch = len(lens)
    if any(n < 1 for n in lens):
        raise ValueError("every decoding sequence attends at least its new token")
    order = sorted(range(batch), key=lens.__getitem__)
    sorted_lens = [lens[b] for b in order]
    key_ns = KEY_NS + KEY_BYTE_NS * key_bytes
    max_keys = max(GROUP_BYTES // key_bytes, 1)
    # A row padded by more keys than a call costs is cheaper in a group of its own, so an
    # optimal group never spans more than this many keys of length: it bounds the search.
    max_spread = CALL_NS / key_ns
    # best[j]: cheapest cost of the first j sorted rows; start[j]: where its last group starts.
    best = [0.0] * (batch + 1)
    start = [0] * (batch + 1)
    lo = 0
    for j in range(1, batch + 1):
        longest = sorted_lens[j - 1]
        while sorted_lens[lo] < longest - max_spread:
            lo += 1
        per_row = key_ns * longest
        first = max(j - max(max_keys // longest, 1), lo)  # rows a group of this length holds
        cost, arg = float("inf"), j - 1
        for i in range(j - 1, first - 1, -1):
            c = best[i] + per_row * (j - i)
            if c < cost:
                cost, arg = c, i
        best[j], start[j] = cost + CALL_NS, arg
    bounds: list[tuple[int, int]] = []  # [first, stop) of each group in sorted order
    stop = batch
    while stop:
        bounds.append((start[stop], stop))
        stop = start[stop]
    return _build(bounds, order, block_tables, lens, page)


def _build(
    bounds: list[tuple[int, int]],
    order: list[int],
    block_tables: Sequence[Sequence[int]],
    lens: list[int],
    page: int,
) -> DecodePlan:
    """Groups over sorted rows ``order[first:stop]``: each row's first ``cdiv(longest, page)``
    pages, shorter tables padded with block 0, whose keys the mask hides."""
    pages = array("q")
    spans: list[tuple[int, int]] = []  # each group's range in `pages`
    for first, stop in bounds:
        n = -(-lens[order[stop - 1]] // page)
        begin = len(pages)
        for b in order[first:stop]:
            table = block_tables[b][:n]
            pages.extend(table)
            if len(table) < n:
                pages.extend([0] * (n - len(table)))
        spans.append((begin, len(pages)))
    # One conversion for the step: each group's pages and lengths are views of these.
    all_pages = int_tensor(pages, torch.long)
    sorted_lens = int_tensor(array("q", [lens[b] for b in order]), torch.long)
    positions = torch.arange(max(lens))
    groups: list[DecodeGroup] = []
    for (first, stop), (begin, end) in zip(bounds, spans, strict=True):
        rows = order[first:stop]
        longest = lens[rows[-1]]
        mask = None
        if lens[rows[0]] != longest:
            valid = sorted_lens[first:stop, None]
            mask = (positions[None, :longest] < valid)[:, None, None, :]  # [g, 1, 1, longest]
        contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
        index = slice(rows[0], rows[-1] + 1) if contiguous else torch.tensor(rows)
        groups.append(DecodeGroup(index, longest, all_pages[begin:end], mask))
    return DecodePlan(len(lens), groups, covers_all=True)
