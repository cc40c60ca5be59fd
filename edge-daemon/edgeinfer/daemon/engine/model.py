"""Decoder-only transformer for the Llama family (Llama, Mistral, Qwen2, Qwen3).

Reads top to bottom like the Hugging Face modelling code it must match, with one change: a
step's tokens are one flat ``[T]`` batch from many sequences, and attention reads and writes
the paged KV cache described by :class:`AttentionMetadata`. Module names equal the checkpoint
tensor names, so loading is a straight copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from edgeinfer.daemon.engine.attention_metadata import AttentionMetadata
from edgeinfer.daemon.engine.kv_cache import KVCache
from edgeinfer.daemon.engine.model_config import ModelConfig
from edgeinfer.daemon.engine.rope import RotaryEmbedding, apply_rotary
from edgeinfer.kernels.paged_attention import decode_attention, paged_prefill_attention_ref


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and cast back before the weight, exactly as transformers does.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


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
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, D]
        sin: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

        flat_k = k_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_v = v_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_k.index_copy_(0, meta.slot_mapping, k)
        flat_v.index_copy_(0, meta.slot_mapping, v)

        out = torch.empty_like(q)  # [T, H, D]
        nd = meta.num_decode_tokens
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        if nd and tables is not None and lens is not None:
            out[:nd] = decode_attention(q[:nd], k_cache, v_cache, tables, lens, self.scale)
        for seg in meta.prefills:
            s, e = seg.start, seg.start + seg.length
            if seg.start_pos == 0:
                # Nothing cached before the chunk: attend to its own K/V without a gather.
                o = F.scaled_dot_product_attention(
                    q[s:e].transpose(0, 1),
                    k[s:e].transpose(0, 1),
                    v[s:e].transpose(0, 1),
                    is_causal=True,
                    scale=self.scale,
                    enable_gqa=True,
                )
                out[s:e] = o.transpose(0, 1)
            else:
                out[s:e] = paged_prefill_attention_ref(
                    q[s:e], k_cache, v_cache, seg.block_table, seg.start_pos, self.scale
                )
        return self.o_proj(out.view(t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        bias = cfg.mlp_bias
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


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
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

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
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, meta, kv_cache.k[i], kv_cache.v[i])
        if logits_indices is not None:
            x = x.index_select(0, logits_indices)
        return self.lm_head(self.model.norm(x)).float()
