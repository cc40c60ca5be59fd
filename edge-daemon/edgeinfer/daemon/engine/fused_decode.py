"""A small CPU decode step's decoder layers in one compiled call (:mod:`decode_layers`).

At one to eight rows a layer's eleven ops are short enough that calling them one by one from
Python costs a large share of the step: SmolLM2 bf16 at batch 1 on 2 EPYC cores took 14.9 ms
a token op by op and 10.7 ms fused.
At the row counts where it beat the layers op by op (its trial, :func:`kernel_trials.choose_fused`,
compares whole steps against whatever kernels the op-by-op layers chose), :class:`FusedDecode`
hands the whole layer stack to the C++ sequencer: the skinny GEMM for every projection, the
compiled pointwise ops and decode attention, in the op-by-op order, so the tokens are those of
the op-by-op path with those kernels, bit for bit.

It takes Llama-shaped layers only: no per-head q/k norms (Qwen3), no layer hooks (per-layer
compressed weights), every weight packed for the skinny GEMM. Anything else, and steps with a
prefill chunk, keep the op-by-op path.
"""

from __future__ import annotations

import torch

from edgeinfer.daemon.engine.attention_metadata import AttentionMetadata
from edgeinfer.daemon.engine.kv_cache import KVCache
from edgeinfer.daemon.engine.model import DecoderLayer
from edgeinfer.daemon.engine.rope import Rotation
from edgeinfer.kernels import decode_layers
from edgeinfer.kernels import paged_attention_native as native
from edgeinfer.kernels.kernel_choice import SizeRoute
from edgeinfer.kernels.skinny_gemm import SkinnyWeight


def _address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


class FusedDecode:
    """The layer stack of one model as :mod:`decode_layers` runs it; build with :meth:`of`."""

    def __init__(self, layers: list[DecoderLayer], kv_cache: KVCache) -> None:
        """Use :meth:`of`, which checks that every layer fits."""
        first = layers[0]
        attn, norm = first.self_attn, first.input_layernorm
        self.dtype = dtype = norm.weight.dtype
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.hidden = norm.weight.shape[0]
        self.inter = first.mlp.down_proj.in_features
        self.dims = decode_layers.Dims(
            self.hidden, self.heads, self.kv_heads, self.head_dim, self.inter, dtype.itemsize,
            norm.eps, attn.scale,
        )  # fmt: skip
        self._weights: list[SkinnyWeight] = []
        table = []
        for i, layer in enumerate(layers):
            a, m = layer.self_attn, layer.mlp
            skinny = [a.qkv.skinny, a.o_proj.skinny, m.gate_up.skinny, m.down_proj.skinny]
            weights = [w for w in skinny if w is not None]
            if len(weights) != len(skinny):
                raise ValueError(f"layer {i} has a projection the skinny GEMM does not hold")
            self._weights += weights
            q, o, gu, d = (w.panels for w in weights)
            if any(w.panels.dtype != self._weights[0].panels.dtype for w in weights):
                raise ValueError(f"layer {i} holds panels in another dtype than the first layer")
            table.append(decode_layers.Layer(
                layer.input_layernorm.weight.data_ptr(),
                layer.post_attention_layernorm.weight.data_ptr(),
                q.data_ptr(), _address(a.qkv.bias), o.data_ptr(), _address(a.o_proj.bias),
                gu.data_ptr(), _address(m.gate_up.bias), d.data_ptr(), _address(m.down_proj.bias),
                kv_cache.k[i].data_ptr(), kv_cache.v[i].data_ptr(),
            ))  # fmt: skip
        self.layers = (decode_layers.Layer * len(table))(*table)
        self._k_cache0 = kv_cache.k[0]
        self.route: SizeRoute | None = None  # see set_route
        self._runs: dict[int, bool] = {}  # rows -> panels held, rows taken, route allows
        self._scratch: dict[int, list[torch.Tensor]] = {}
        self._ops: decode_layers.Ops | None = None

    @classmethod
    def of(cls, layers: list[torch.nn.Module], kv_cache: KVCache) -> FusedDecode | None:
        """The fused stack for these layers and caches, or None where it cannot take them."""
        decoders = [layer for layer in layers if isinstance(layer, DecoderLayer)]
        if not decoders or len(decoders) != len(layers):
            return None
        first = decoders[0]
        dtype = first.input_layernorm.weight.dtype
        if not decode_layers.available(dtype) or kv_cache.k[0].device.type != "cpu":
            return None
        skinny = first.self_attn.qkv.skinny
        panels = skinny.panels.dtype if skinny is not None else None
        for layer in decoders:
            a, m = layer.self_attn, layer.mlp
            projections = (a.qkv, a.o_proj, m.gate_up, m.down_proj)
            if (
                a.q_norm is not None
                or layer._forward_hooks
                or layer._forward_pre_hooks
                # one GEMM entry for every projection: all panels float32, or all halved
                or any(p.skinny is None or p.skinny.panels.dtype != panels for p in projections)
                or any(
                    p.bias is not None and (p.bias.dtype != dtype or not p.bias.is_contiguous())
                    for p in projections
                )
            ):
                return None
        attn = first.self_attn
        probe = kv_cache.k[0].new_empty(0, attn.num_heads, attn.head_dim)
        if (
            kv_cache.layout.dtype != dtype
            or len(kv_cache.k) != len(decoders)
            or not native.supports(probe, kv_cache.k[0])
        ):
            return None
        return cls(decoders, kv_cache)

    def set_route(self, route: SizeRoute | None) -> None:
        """The row counts where it runs from now on (:func:`kernel_trials.choose_fused`: where
        it beat the op-by-op layers, whichever kernels those chose); None: wherever it can."""
        self.route = route
        self._runs.clear()

    def runs(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this step (``x [rows, hidden]``) takes the fused path."""
        rows = x.shape[0]
        if meta.prefills or meta.num_decode_tokens != rows or x.dtype != self.dtype:
            return False
        known = self._runs.get(rows)
        if known is None:
            # The skinny GEMM's own routes do not matter here (the trial compared whole steps),
            # only that it holds every panel (none given back) and takes this many rows.
            known = self._runs[rows] = all(
                0 < rows <= w.max_rows and w.panels.numel() for w in self._weights
            ) and (self.route is None or self.route(rows))
        return known and meta.decode_block_tables is not None

    def __call__(self, x: torch.Tensor, rot: Rotation, meta: AttentionMetadata) -> torch.Tensor:
        """Every layer on ``x [rows, hidden]`` (overwritten and returned); see :meth:`runs`."""
        rows = x.shape[0]
        # The step's compiled attention (prepared for the op-by-op layers where its trial
        # chose it; here it always runs, the fused trial having timed it so).
        prepared = meta.native_decode(self.heads, self._k_cache0)
        if prepared is None:
            tables, lens = meta.decode_block_tables, meta.decode_context_lens
            if tables is None or lens is None:
                raise RuntimeError("a decode step without block tables")
            k0 = self._k_cache0
            prepared = native.PreparedDecode(tables, lens, k0.shape, k0.dtype, self.heads)
        kernels = self._ops
        if kernels is None:
            kernels = self._ops = decode_layers.ops(
                self.dtype, prepared.entry_address(), self._weights[0].panels.dtype
            )
            if kernels is None:
                raise RuntimeError("the fused decode kernels are not built here")
        scratch = self._scratch.get(rows)
        if scratch is None:
            h, hkv, d, hidden, inter = (
                self.heads, self.kv_heads, self.head_dim, self.hidden, self.inter,
            )  # fmt: skip
            widths = (hidden, (h + 2 * hkv) * d, h * d, hidden, hidden, 2 * inter, inter, hidden)
            scratch = [x.new_empty(rows, w) for w in widths]
            self._scratch[rows] = scratch
        slots = meta.slot_mapping
        if not x.is_contiguous() or slots.dtype != torch.int64 or not slots.is_contiguous():
            raise ValueError("a fused decode step needs contiguous rows and int64 slots")
        cos, sin = rot.cos.contiguous(), rot.signed_sin.contiguous()  # [rows, 1, D]
        step = decode_layers.Step(
            rows, x.data_ptr(), slots.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            prepared.problem_address(), *(t.data_ptr() for t in scratch),
        )  # fmt: skip
        decode_layers.run(
            self.dtype, kernels, self.layers, self.dims, step, torch.get_num_threads()
        )
        return x
