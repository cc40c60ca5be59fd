"""Which CPU decode-attention kernel a step's KV cache takes.

Two kernels attend a step's decode tokens on the CPU: numba's
(:mod:`edgeinfer.kernels.paged_attention_numba`) reads each key where it lies in its page, and
torch's (:func:`~edgeinfer.kernels.paged_attention_cpu.paged_decode_attention_cpu`) gathers the
pages of length-sorted groups into padded copies for ``scaled_dot_product_attention``, on a plan
made once per step (:func:`~edgeinfer.kernels.paged_attention_cpu.plan_decode_cpu`).
"""

from __future__ import annotations

import torch

# From this many K+V values per cached token, decode attention skips the plan for numba's
# kernel: on 2 EPYC cores 0.5-0.8x the torch path's time on SmolLM2's 3 x 64 heads (384 values)
# at batch 1-32 in float32, and less still in bfloat16, which the torch path upcasts as it
# gathers; on narrow heads (the tiny preset's 2 x 16, 64 values) torch's two threads win.
IN_PLACE_MIN_KV_VALUES = 256
_IN_PLACE_DTYPES = (torch.float32, torch.bfloat16)


def decode_in_place(dtype: torch.dtype, kv_values: int) -> bool:
    """Whether CPU decode attention of this cache runs in place (see above) or on a plan;
    ``kv_values`` counts a cached token's keys and values over every KV head."""
    return dtype in _IN_PLACE_DTYPES and kv_values >= IN_PLACE_MIN_KV_VALUES
