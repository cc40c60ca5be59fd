"""Decoder-only transformer for the Llama family (Llama, Mistral, Qwen2, Qwen3).

Reads top to bottom like the Hugging Face modelling code it must match, with one change: a
step's tokens are one flat ``[T]`` batch from many sequences, and attention reads and writes
the paged KV cache described by :class:`AttentionMetadata`. Module names equal the checkpoint
tensor names, so loading is a straight copy; q/k/v and gate/up then each run as one matmul over
a stacked weight whose rows the checkpoint parameters are views of (:class:`FusedProjection`),
and on the CPU every float32 projection (bfloat16 too, on CPUs with bf16 dot products) runs on
oneDNN with packed weights (:mod:`linear`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from edgeinfer.daemon.engine.attention_backend import AttentionBackend
from edgeinfer.daemon.engine.attention_metadata import AttentionMetadata
from edgeinfer.daemon.engine.kv_cache import KVCache
from edgeinfer.daemon.engine.linear import Linear, can_pack, linear, pack
from edgeinfer.daemon.engine.model_config import ModelConfig
from edgeinfer.daemon.engine.rope import RotaryEmbedding, Rotation
from edgeinfer.kernels import decoder_pointwise, skinny_gemm
from edgeinfer.kernels.skinny_gemm import SkinnyWeight

if TYPE_CHECKING:
    from edgeinfer.daemon.engine.fused_decode import FusedDecode


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if decoder_pointwise.runs("rms_norm", x):  # one compiled pass, rounded as below
            return decoder_pointwise.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            # The same ops as below in one call (bit-identical): less dispatch per token.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in float32 and cast back before the weight, as transformers does; the fused
        # op normalises exactly like its mean/rsqrt (float32 is bit-identical, see above).
        normed = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return self.weight * normed.to(x.dtype)

    def add_forward(
        self, x: torch.Tensor, delta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + delta, forward(x + delta))``: a residual add and the norm after it."""
        if decoder_pointwise.runs("add_rms_norm", x):
            return decoder_pointwise.add_rms_norm(x, delta, self.weight, self.eps)
        total = x + delta
        return total, self.forward(total)


class FusedProjection(nn.Module):
    """Projections of one input computed as one matmul: ``[x @ W1.T + b1, x @ W2.T + b2, ...]``.

    :meth:`fuse` stacks the weights into one ``[sum(out), in]`` tensor and makes each
    projection's parameter a view of its rows, so checkpoint names, loading (a copy into the
    parameter) and tensor-parallel slicing are untouched. Until then, or after :meth:`unfuse`,
    each projection runs on its own.
    """

    def __init__(self, *projections: nn.Linear) -> None:
        super().__init__()
        if len({p.bias is None for p in projections}) > 1:
            raise ValueError("fused projections must all have a bias or none")
        # A plain list, not submodules: the parameters keep their checkpoint names only.
        self._projections = list(projections)
        self.weight: torch.Tensor | None = None  # [sum(out), in]
        self.bias: torch.Tensor | None = None  # [sum(out)]
        self.skinny: SkinnyWeight | None = None  # the weight in skinny_gemm's panels, once packed
        self.sizes = [p.out_features for p in projections]

    def fuse(self) -> None:
        weight = torch.cat([p.weight.detach() for p in self._projections])  # [sum(out), in]
        for p, rows in zip(self._projections, weight.split(self.sizes), strict=True):
            p.weight.data = rows
        biases = [p.bias for p in self._projections if p.bias is not None]
        bias = torch.cat([b.detach() for b in biases]) if biases else None
        for b, part in zip(biases, bias.split(self.sizes) if bias is not None else (), strict=True):
            b.data = part
        self.weight, self.bias = weight, bias

    def unfuse(self) -> None:
        """Drop the stacked tensors (call after the parameters were given other storage)."""
        self.weight = self.bias = self.skinny = None

    def pack(self) -> None:
        """Keep the fused weight in oneDNN's packed layout (see :func:`linear.pack`) and as
        :func:`skinny_gemm.prepare` of it where that applies; the parameters are emptied. A no-op unless
        fused and :func:`linear.can_pack`."""
        if self.weight is None or not can_pack(self.weight):
            return
        self.skinny = skinny_gemm.prepare(self.weight)
        self.weight = pack(self.weight)
        for p in self._projections:
            p.weight.data = p.weight.new_empty(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., sum(out)]``: the projections side by side, in their order."""
        if self.weight is None:
            return torch.cat([p(x) for p in self._projections], dim=-1)
        return linear(x, self.weight, self.bias, self.skinny)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        qkv_bias = cfg.attention_bias
        # Qwen2 biases q/k/v only; Llama and Qwen3 apply attention_bias to o_proj as well.
        o_bias = cfg.attention_bias and cfg.architecture != "Qwen2ForCausalLM"
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=qkv_bias)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=qkv_bias)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=qkv_bias)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.qkv = FusedProjection(self.q_proj, self.k_proj, self.v_proj)
        # Set at load for the device and cache (CausalLM.use_attention); portable until then.
        self.backend = AttentionBackend()

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rot: Rotation,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        t, h, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv.forward(x).view(t, h + 2 * hkv, d)  # heads of q, then k, then v
        v = qkv[:, h + hkv :]
        if self.q_norm is not None and self.k_norm is not None:
            q = rot.rotated(self.q_norm.forward(qkv[:, :h]))
            k = rot.rotated(self.k_norm.forward(qkv[:, h : h + hkv]))
        else:
            qk = rot.rotated(qkv[:, : h + hkv])  # q and k rotate together: [T, H + Hkv, D]
            q, k = qk[:, :h], qk[:, h:]

        flat_k = k_cache.view(-1, hkv, d)
        flat_v = v_cache.view(-1, hkv, d)
        flat_k.index_copy_(0, meta.slot_mapping, k)
        flat_v.index_copy_(0, meta.slot_mapping, v)

        out = q.new_empty(t, h, d)
        nd = meta.num_decode_tokens
        if nd:
            self.backend.decode(q[:nd], k_cache, v_cache, meta, self.scale, out[:nd])
        for seg in meta.prefills:
            s, e = seg.start, seg.start + seg.length
            self.backend.prefill(
                q[s:e], k[s:e], v[s:e], seg, k_cache, v_cache, self.scale, out[s:e]
            )
        return self.o_proj.forward(out.view(t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        bias = cfg.mlp_bias
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)
        self.gate_up = FusedProjection(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up.forward(x)  # [T, 2 * intermediate]: gate, then up
        if decoder_pointwise.runs("silu_mul", gate_up):
            return self.down_proj.forward(decoder_pointwise.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj.forward(F.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rot: Rotation,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        # Submodules run through ``forward``: ``nn.Module.__call__`` costs microseconds per
        # call (10 per layer per step) and only whole layers carry hooks (compressed_weights).
        attn = self.self_attn.forward(self.input_layernorm.forward(x), rot, meta, k_cache, v_cache)
        x, normed = self.post_attention_layernorm.add_forward(x, attn)
        return x + self.mlp.forward(normed)

    def fuse_projections(self) -> None:
        """One matmul for q/k/v and one for gate/up (see :class:`FusedProjection`)."""
        self.self_attn.qkv.fuse()
        self.mlp.gate_up.fuse()

    def unfuse_projections(self) -> None:
        self.self_attn.qkv.unfuse()
        self.mlp.gate_up.unfuse()

    def pack_weights(self) -> None:
        self.self_attn.qkv.pack()
        self.self_attn.o_proj.pack()
        self.mlp.gate_up.pack()
        self.mlp.down_proj.pack()


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.rotary_emb = RotaryEmbedding(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # The layer stack as one compiled call for small decode steps (set by the runner).
        self.fused_decode: FusedDecode | None = None

    def use_attention(self, backend: AttentionBackend) -> None:
        """Have every decoder layer this model holds attend with ``backend`` (chosen once,
        at load, for the device and KV cache: see :func:`attention_backend`)."""
        for layer in self.model.layers:
            if isinstance(layer, DecoderLayer):
                layer.self_attn.backend = backend

    def fuse_projections(self) -> None:
        """Fuse the projections of every decoder layer this model holds; call once the
        parameters have their final device and dtype, before or after loading them."""
        for layer in self.model.layers:
            if isinstance(layer, DecoderLayer):  # pipeline stages hold placeholders elsewhere
                layer.fuse_projections()

    def pack_weights(self) -> None:
        """Where :func:`linear.can_pack` allows, hold every projection's weight in oneDNN's
        packed layout only: the parameters are emptied, so call this once, after loading, and
        never with weights that change afterwards (per-layer compressed weights). A tied LM
        head keeps the embedding's weight and packs a copy."""
        for layer in self.model.layers:
            if isinstance(layer, DecoderLayer):
                layer.pack_weights()
        if isinstance(self.lm_head, Linear):
            self.lm_head.pack(keep_weight=self.config.tie_word_embeddings)

    def packed_weights(self) -> list[torch.Tensor]:
        """The oneDNN-packed weights :meth:`pack_weights` left (none where it could not pack)."""
        weights = [m.weight for m in self.modules() if isinstance(m, FusedProjection)]
        weights += [m.packed for m in self.modules() if isinstance(m, Linear)]
        return [w for w in weights if w is not None and w.is_mkldnn]

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_cache: KVCache,
        logits_indices: torch.Tensor | None = None,  # [N] rows of T whose logits are needed
        max_position: int | None = None,  # max(positions), known on the host: avoids a sync
    ) -> torch.Tensor:
        """Run one step; returns float32 logits ``[N, vocab]`` (``[T, vocab]`` if no indices)."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, max_position)
        rot = Rotation.build(cos, sin, x.dtype)
        if self.fused_decode is not None and self.fused_decode.runs(x, meta):
            x = self.fused_decode(x, rot, meta)
        else:
            for i, layer in enumerate(self.model.layers):
                x = layer(x, rot, meta, kv_cache.k[i], kv_cache.v[i])
        if logits_indices is not None:
            x = x.index_select(0, logits_indices)
        return self.lm_head(self.model.norm(x)).float()
