"""Which CPU attention kernel a step's decode tokens and prefill chunks take.

Decode: three kernels. Two read each key where it lies in its page: the compiled one
(:mod:`edgeinfer.kernels.paged_attention_native`, C++ on torch's OpenMP threads) and numba's
(:mod:`edgeinfer.kernels.paged_attention_numba`, one thread), the portable fallback for hosts
where the C++ one did not build. The third, torch's
(:func:`~edgeinfer.kernels.paged_attention_cpu.paged_decode_attention_cpu`), gathers the pages
of length-sorted groups into padded copies for ``scaled_dot_product_attention``, on a plan made
once per step (:func:`~edgeinfer.kernels.paged_attention_cpu.plan_decode_cpu`).

Prefill: the compiled kernel, in float32 and bf16 alike. (bf16 once kept oneDNN's bf16 matmuls
after a cached prefix and for chunks of 1024+ tokens; since the kernel stopped feeding masked
scores to exp() it is 1.3-1.4x faster than them from 1024 tokens and within 0.9-1.2x after a
prefix.) Without it, torch's flash kernel or those matmuls
(:func:`~edgeinfer.kernels.paged_attention_cpu.paged_prefill_attention_cpu`).

A chunk after a cached prefix that the compiled kernel does not take attends *grouped* (a KV
head's query heads as rows of one matrix) at the chunk sizes where that beat repeating the
heads when timed at load; elsewhere, and before any timing, the heads are repeated.

Where the compiled kernels build, they run at the batch sizes (decode) and chunk sizes
(prefill) where they beat the portable path on this host when timed at load (the engine's
``kernel_trials`` sets the routes); until then, everywhere they take the tensors.
"""

from __future__ import annotations

import torch
from torch import Tensor

from edgeinfer.kernels import paged_attention_native as native
from edgeinfer.kernels.kernel_choice import SizeRoute

# Without the compiled kernel, from this many K+V values per cached token decode attention
# skips the plan for numba's kernel: on 2 EPYC cores 0.5-0.8x the torch path's time on
# SmolLM2's 3 x 64 heads (384 values) at batch 1-32 in float32, and less still in bfloat16,
# which the torch path upcasts as it gathers; on narrow heads (the tiny preset's 2 x 16, 64
# values) torch's two threads beat numba's one. The compiled kernel runs on every thread and
# beats both in the engine on both widths: on the tiny preset's heads 0.27 against the plan's
# 0.46 ms per layer (64 sequences), on SmolLM2's 5-8 against numba's 12-17 ms per step (8
# sequences of ~300 tokens, float32).
IN_PLACE_MIN_KV_VALUES = 256
_IN_PLACE_DTYPES = (torch.float32, torch.bfloat16)


# (dtype, K+V values per cached token) -> where the compiled kernel runs: by decode batch size,
# by prefill chunk tokens. Absent: wherever it takes the tensors.
_decode_routes: dict[tuple[torch.dtype, int], SizeRoute] = {}
_prefill_routes: dict[tuple[torch.dtype, int], SizeRoute] = {}
# The same key -> the chunk sizes at which a chunk after a cached prefix attends grouped.
# Absent: nowhere (the layout is torch's either way: no build to trust before timing it).
_grouped_routes: dict[tuple[torch.dtype, int], SizeRoute] = {}


def values_per_token(k_cache: Tensor) -> int:
    """K and V values of one cached token over every KV head (``[blocks, page, Hkv, D]``)."""
    return 2 * k_cache.shape[2] * k_cache.shape[3]


def set_decode_route(dtype: torch.dtype, values: int, route: SizeRoute | None) -> None:
    """The decode batch sizes at which the compiled kernel attends caches of ``dtype`` with
    ``values`` K+V values per token (None: every size)."""
    _set(_decode_routes, (dtype, values), route)


def set_prefill_route(dtype: torch.dtype, values: int, route: SizeRoute | None) -> None:
    """The prefill chunk sizes (tokens) at which the compiled kernel attends such caches."""
    _set(_prefill_routes, (dtype, values), route)


def set_grouped_route(dtype: torch.dtype, values: int, route: SizeRoute | None) -> None:
    """The chunk sizes (tokens) at which chunks after a prefix attend such caches grouped."""
    _set(_grouped_routes, (dtype, values), route)


def _set(
    routes: dict[tuple[torch.dtype, int], SizeRoute],
    key: tuple[torch.dtype, int],
    route: SizeRoute | None,
) -> None:
    if route is None:
        routes.pop(key, None)
    else:
        routes[key] = route


def _native_decodes(dtype: torch.dtype, values: int, batch: int) -> bool:
    route = _decode_routes.get((dtype, values))
    return native.available() and (route is None or route(batch))


def decode_in_place(dtype: torch.dtype, kv_values: int, batch: int = 1) -> bool:
    """Whether CPU decode attention of this cache runs in place (see above) or on a plan;
    ``kv_values`` counts a cached token's keys and values over every KV head."""
    if dtype not in _IN_PLACE_DTYPES:
        return False
    return _native_decodes(dtype, kv_values, batch) or kv_values >= IN_PLACE_MIN_KV_VALUES


def prepare_native_decode(
    block_tables: Tensor,  # [B, max_blocks] int32
    context_lens: Tensor,  # [B] int32
    k_cache: Tensor,  # one layer's [num_blocks, block_size, Hkv, D]; all layers alike
    heads: int,
) -> native.PreparedDecode | None:
    """The step's compiled decode attention for every layer, or None where it does not take
    this cache or lost to numba's kernel at this batch size (``paged_decode_attention_numba``
    then serves layer by layer)."""
    probe = k_cache.new_empty(0, heads, k_cache.shape[-1])
    batch = block_tables.shape[0]
    if not native.supports(probe, k_cache) or not _native_decodes(
        k_cache.dtype, values_per_token(k_cache), batch
    ):
        return None
    return native.PreparedDecode(block_tables, context_lens, k_cache.shape, k_cache.dtype, heads)


def prefill_in_place(q: Tensor, k_cache: Tensor) -> bool:
    """Whether the compiled kernel attends this prefill chunk (``q`` [T, H, D]; see above)."""
    if not native.supports(q, k_cache):
        return False
    route = _prefill_routes.get((k_cache.dtype, values_per_token(k_cache)))
    return route is None or route(q.shape[0])


def prefill_grouped(q: Tensor, k_cache: Tensor) -> bool:
    """Whether a chunk after a cached prefix (``q`` [T, H, D]) attends grouped (see above)."""
    route = _grouped_routes.get((k_cache.dtype, values_per_token(k_cache)))
    return route is not None and route(q.shape[0])
