"""Which CPU decode-attention kernel a step's KV cache takes.

Two kernels attend a step's decode tokens on the CPU: numba's
(:mod:`edgeinfer.kernels.paged_attention_numba`) reads each key where it lies in its page, and
torch's (:func:`~edgeinfer.kernels.paged_attention_cpu.paged_decode_attention_cpu`) gathers the
pages of length-sorted groups into padded copies for ``scaled_dot_product_attention``, on a plan
made once per step (:func:`~edgeinfer.kernels.paged_attention_cpu.plan_decode_cpu`).
"""

from __future__ import annotations

import torch

# From this many K+V bytes per cached token (float32), decode attention skips the plan for
# numba's kernel: on 2 EPYC cores 0.5-0.8x the torch path's time on SmolLM2's 3 x 64 heads
# (1.5 KiB) at batch 1-32, while on narrow heads (the tiny preset's 2 x 16, 256 B) torch's two
# threads win by ~15%.
IN_PLACE_MIN_KEY_BYTES = 1024


def decode_in_place(dtype: torch.dtype, key_bytes: int) -> bool:
    """Whether CPU decode attention of this cache runs in place (see above) or on a plan."""
    return dtype == torch.float32 and key_bytes >= IN_PLACE_MIN_KEY_BYTES
