"""Dense projections, routed to oneDNN for float32 and bfloat16 on the CPU.

``F.linear`` sends float32 CPU matmuls to MKL, which on AMD CPUs runs its AVX2 code (MKL only
takes its AVX-512 paths on Intel). oneDNN, which every x86 torch wheel ships, runs AVX-512 on
both and measured 1.3-2.5x faster than MKL on the engine's shapes (1 to 2048 tokens against
576 x 1536 weights) on an AMD EPYC, with the same float32 arithmetic (no reduced-precision
mode). Everything else (CUDA, float16, torch builds without oneDNN, and float32 weights
under ``ONEDNN_MIN_FLOAT32_WEIGHT`` elements, such as the tiny preset's) uses ``F.linear``.

:func:`pack` reorders a weight once into oneDNN's blocked layout, which spares the matmul its
per-call layout handling: another 1.2x (1 token) to 1.45x (8 tokens) on a whole decode step's
projections. A packed weight is an opaque ``mkldnn`` tensor that only :func:`linear` reads.
bfloat16 weights are packed too where the CPU has bf16 dot products (AVX512-BF16 or AMX):
there a whole SmolLM2 decode step's projections at 8 tokens took 10.5 ms against 18.1 ms in
packed float32, and a 256-token prefill chunk's 81 ms against 186 ms (2 EPYC cores).

Steps of up to eight rows (decode of up to eight sequences) can run on
:mod:`~edgeinfer.kernels.skinny_gemm` instead, which streams a copy of the weight laid out in
panels closer to the memory's read bandwidth than oneDNN's matmul does (float32: 1.1-1.4x on
SmolLM2's projections on the hosts it was written on; bfloat16, where the build has AVX512-BF16:
1.5x at one row): it runs at the shapes and row counts where it beat oneDNN at load
(``kernel_trials``), and a weight where it never did gives its panels back. Until then such
weights are held twice, in panels and packed (``EDGEINFER_NATIVE_KERNELS=0`` keeps only the
packed copy).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from edgeinfer.kernels import skinny_gemm
from edgeinfer.kernels.cpu_features import native_bf16
from edgeinfer.kernels.skinny_gemm import SkinnyWeight

_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
# The row count oneDNN tunes a packed layout for; any other count still works with it.
_PACK_ROWS = 8
# float32 weights with fewer elements stay on ``F.linear`` (MKL): oneDNN builds a kernel for
# every new row count (0.4-0.6 ms for a 64 x 192 weight, ~1.6 ms for 576 x 960), which a small
# weight never earns back, and at decode batch sizes MKL is faster on it (5 vs 14 us at 8 rows
# for 192 x 64; 2 EPYC cores). From SmolLM2's 576 x 576 up oneDNN wins 2-2.5x per call.
ONEDNN_MIN_FLOAT32_WEIGHT = 1 << 16


def can_pack(weight: torch.Tensor) -> bool:
    if not _ONEDNN or weight.device.type != "cpu":
        return False
    if weight.dtype == torch.float32:
        return weight.numel() >= ONEDNN_MIN_FLOAT32_WEIGHT
    return weight.dtype == torch.bfloat16 and native_bf16()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` (CPU; see :func:`can_pack`) in oneDNN's blocked layout."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_ROWS)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    skinny: SkinnyWeight | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x [..., in]`` and ``weight [out, in]`` (or :func:`pack` of
    it); ``skinny`` is ``skinny_gemm.prepare`` of the weight, used for steps of a few rows."""
    if skinny is not None and skinny.runs(x.numel() // x.shape[-1]):
        return skinny_gemm.skinny_linear(x, skinny, bias)
    # oneDNN takes a packed weight, and a plain one where it would have been packed.
    if x.dtype == weight.dtype and (weight.is_mkldnn or can_pack(weight)):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and checkpoint names) computed by :func:`linear`."""

    packed: torch.Tensor | None = None
    skinny: SkinnyWeight | None = None  # skinny_gemm.prepare(weight) while packed

    def pack(self, *, keep_weight: bool = False) -> None:
        """Compute with a packed copy of the weight, and a ``skinny_gemm`` one where it applies
        (no-op where :func:`can_pack` is False); the parameter is emptied unless
        ``keep_weight`` (a weight shared with another module)."""
        if not can_pack(self.weight):
            return
        self.packed = pack(self.weight)
        self.skinny = skinny_gemm.prepare(self.weight)
        if not keep_weight:
            self.weight.data = self.weight.new_empty(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return linear(x, self.weight, self.bias)
        return linear(x, self.packed, self.bias, self.skinny)
