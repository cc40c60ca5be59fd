"""What the CPU computes in hardware, where a kernel's choice of path depends on it."""

from __future__ import annotations

import torch


def native_bf16() -> bool:
    """Whether this CPU computes bfloat16 dot products in hardware (AVX512-BF16 or AMX); else
    oneDNN emulates them, slower than float32, and bf16 matmuls lose their edge."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
