"""Rotary position embeddings, numerically identical to transformers' implementation.

The inverse frequencies follow ``transformers.modeling_rope_utils`` for the ``default``,
``linear``, ``llama3`` and ``yarn`` types, and cos/sin use the "rotate_half" layout
(``cat(freqs, freqs)``) of the Hugging Face Llama family, so weights need no permutation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from edgeinfer.daemon.engine.model_config import ModelConfig
from edgeinfer.kernels import decoder_pointwise

# The cache starts at this many positions (or max_position_embeddings if smaller) and doubles.
_INITIAL_CACHE = 4096


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Return ``(inv_freq [head_dim // 2] float32, attention_scaling)`` for ``cfg.rope``."""
    rope = cfg.rope
    dim = cfg.head_dim
    # Exponents built in int64 then cast, exactly as transformers does, so values match bitwise.
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    if rope.rope_type == "default":
        return 1.0 / (rope.theta**exponents), 1.0
    if rope.rope_type == "linear":
        return 1.0 / (rope.theta**exponents) / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(cfg, 1.0 / (rope.theta**exponents)), 1.0
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(cfg, rope.theta**exponents)
    raise ValueError(f"unsupported rope_type {rope.rope_type!r}")


def _llama3_inv_freq(cfg: ModelConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    rope = cfg.rope
    old_context = rope.original_max_position_embeddings or cfg.max_position_embeddings
    low_freq_wavelen = old_context / rope.low_freq_factor
    high_freq_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are interpolated by `factor`, short ones kept, the band between blended.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(cfg: ModelConfig, pos_freqs: torch.Tensor) -> tuple[torch.Tensor, float]:
    rope = cfg.rope
    dim = cfg.head_dim
    factor = rope.factor
    attention = rope.attention_factor
    if attention is None:
        if rope.mscale and rope.mscale_all_dim:
            attention = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(
                factor, rope.mscale_all_dim
            )
        else:
            attention = _yarn_mscale(factor)
    original = rope.original_max_position_embeddings or cfg.max_position_embeddings

    def correction_dim(rotations: float) -> float:
        # The dimension index at which the wavelength completes `rotations` turns over `original`.
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoids a division by zero in the ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (
        1.0 / pos_freqs
    ) * extrapolation_weight
    return inv_freq, float(attention)


class RotaryEmbedding(nn.Module):
    """Maps positions to ``(cos, sin)``, each ``[T, head_dim]`` float32, from a growing cache.

    The cache lives in non-persistent buffers so ``.to(device)`` moves it with the model. It grows
    by doubling when a position beyond it is requested; call :meth:`ensure_capacity` before CUDA
    graph capture, since growing allocates.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = rope_inv_freq(cfg)
        self.max_position_embeddings = cfg.max_position_embeddings
        self.inv_freq: torch.Tensor
        self.cos_cache: torch.Tensor
        self.sin_cache: torch.Tensor
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        empty = torch.empty(0, cfg.head_dim, dtype=torch.float32)
        self.register_buffer("cos_cache", empty, persistent=False)
        self.register_buffer("sin_cache", empty.clone(), persistent=False)

    @property
    def capacity(self) -> int:
        return self.cos_cache.shape[0]

    def ensure_capacity(self, num_positions: int) -> None:
        """Make positions ``0 .. num_positions - 1`` available without recomputation."""
        if num_positions <= self.capacity:
            return
        size = max(self.capacity, min(_INITIAL_CACHE, self.max_position_embeddings), 1)
        while size < num_positions:
            size *= 2
        positions = torch.arange(size, device=self.inv_freq.device, dtype=torch.float32)
        # Same operation order as transformers: float32 outer product, cat, cos/sin, then scale.
        freqs = positions[:, None] * self.inv_freq.float()[None, :]  # [size, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [size, head_dim]
        self.cos_cache = emb.cos() * self.attention_scaling
        self.sin_cache = emb.sin() * self.attention_scaling

    def forward(
        self, positions: torch.Tensor, max_position: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` is a LongTensor ``[T]``; returns ``(cos, sin)`` each ``[T, head_dim]``.

        ``max_position`` (the largest value in ``positions``) lets a caller that already knows it
        avoid the device-to-host sync of ``positions.max()``.
        """
        if positions.numel():
            if max_position is None:
                max_position = int(positions.max().item())
            self.ensure_capacity(max_position + 1)
        return self.cos_cache[positions], self.sin_cache[positions]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, H, D]`` by ``cos``/``sin [T, D]``; cos/sin are cast to ``x.dtype`` first,
    as transformers does, so half-precision results match it."""
    cos = cos.to(x.dtype).unsqueeze(1)  # [T, 1, D] broadcasts over heads
    sin = sin.to(x.dtype).unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


@dataclass(frozen=True)
class Rotation:
    """One step's rotation, prepared once for every layer: ``apply`` equals :func:`apply_rotary`
    bit for bit with three elementwise ops instead of six.

    ``rotate_half(x) * sin`` is ``roll(x, D / 2) * sin'`` with the first half of ``sin'``
    negated: both multiply the same values up to an exact sign flip.
    """

    cos: torch.Tensor  # [T, 1, D], in the activations' dtype
    signed_sin: torch.Tensor  # [T, 1, D]

    @classmethod
    def build(cls, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> Rotation:
        """From ``cos``/``sin`` ``[T, D]`` (:class:`RotaryEmbedding`), cast as transformers does."""
        sin = sin.to(dtype)
        half = sin.shape[-1] // 2
        signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        return cls(cos.to(dtype).unsqueeze(1), signed.unsqueeze(1))

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [T, H, D]``."""
        rolled = torch.roll(x, x.shape[-1] // 2, dims=-1)  # cat(x2, x1)
        return x * self.cos + rolled * self.signed_sin

    def rotated(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`apply`, in place where the compiled kernel takes ``x`` (on the CPU): for a
        step's fresh q/k projections, which nothing else reads unrotated."""
        if decoder_pointwise.runs("rotate", x) and x.stride(-1) == 1:
            return decoder_pointwise.rotate_(x, self.cos, self.signed_sin)
        return self.apply(x)
