"""Tensor parallelism applied to the built model, and loading of exactly one rank's slices.

The model is built on the meta device from :meth:`ParallelLayout.shard_config`, so the
column-parallel projections (q/k/v, gate/up) already have the shard's shapes and need no
communication. Three kinds of module are swapped in: :class:`RowParallelLinear` (o_proj,
down_proj: one all-reduce each), :class:`VocabParallelEmbedding` (mask, look up, all-reduce) and
:class:`ParallelLMHead` (local logits, all-gather). Layers outside the rank's pipeline stage are
replaced by parameter-less placeholders so they allocate nothing and load nothing.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from edgeinfer.daemon.engine.checkpoint import CheckpointReader
from edgeinfer.daemon.engine.errors import ModelLoadError
from edgeinfer.daemon.engine.model import CausalLM, DecoderLayer
from edgeinfer.daemon.engine.model_config import ModelConfig
from edgeinfer.daemon.engine.parallel.comm import Comm
from edgeinfer.daemon.engine.parallel.layout import ParallelLayout
from edgeinfer.daemon.engine.parallel.progress import StoreProgress
from edgeinfer.daemon.engine.rope import RotaryEmbedding


class RowParallelLinear(nn.Module):
    """``all_reduce(x @ W_shard.T) + b``: the input dimension is split across the TP ranks."""

    def __init__(self, like: nn.Linear, comm: Comm) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty_like(like.weight))  # [out, in / tp]
        # Added once, after the sum: every rank holds the full bias.
        self.bias = None if like.bias is None else nn.Parameter(torch.empty_like(like.bias))
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.comm.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    def __init__(self, rows: range, shard: int, hidden: int, comm: Comm) -> None:
        super().__init__()
        self.start, self.num_real = rows.start, len(rows)
        self.weight = nn.Parameter(torch.empty(shard, hidden))  # [ceil(V / tp), hidden]
        self.comm = comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_real)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        # Each id lives on exactly one rank; the others contribute zeros to the sum.
        return self.comm.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))


class ParallelLMHead(nn.Module):
    def __init__(self, shard: int, hidden: int, vocab_size: int, comm: Comm) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shard, hidden))  # [ceil(V / tp), hidden]
        self.vocab_size = vocab_size
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, V]
        local = F.linear(x, self.weight)
        if x.shape[0] == 0:
            return local.new_empty(0, self.vocab_size)  # every rank agrees N == 0: no gather
        return self.comm.all_gather(local, dim=-1)[:, : self.vocab_size]


def build_shard(
    cfg: ModelConfig,
    layout: ParallelLayout,
    rank: int,
    comm: Comm,
    device: torch.device,
    dtype: torch.dtype,
) -> CausalLM:
    """This rank's part of the model, allocated on ``device`` but not yet loaded."""
    stage, t = layout.coords(rank)
    layers = layout.stage_layers(stage, cfg.num_layers)
    first, last = stage == 0, stage == layout.pp - 1
    shard = layout.vocab_shard(cfg.vocab_size)
    with torch.device("meta"):
        model = CausalLM(layout.shard_config(t, cfg))
        body = model.model
        for i, layer in enumerate(body.layers):
            if i not in layers:
                body.layers[i] = nn.Identity()
            elif layout.tp > 1:
                decoder = cast(DecoderLayer, layer)  # ModuleList items are typed Module
                attn, mlp = decoder.self_attn, decoder.mlp
                attn.add_module("o_proj", RowParallelLinear(attn.o_proj, comm))
                mlp.add_module("down_proj", RowParallelLinear(mlp.down_proj, comm))
        if layout.tp > 1:
            rows = layout.vocab(t, cfg.vocab_size)
            body.add_module(
                "embed_tokens", VocabParallelEmbedding(rows, shard, cfg.hidden_size, comm)
            )
            model.add_module(
                "lm_head", ParallelLMHead(shard, cfg.hidden_size, cfg.vocab_size, comm)
            )
        # add_module: these slots now hold other module types (or none at all on this stage).
        if not first:
            body.add_module("embed_tokens", None)
        if not last:
            body.add_module("norm", None)
            model.add_module("lm_head", None)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings and first and last:
        model.lm_head.weight = model.model.embed_tokens.weight  # to_empty unties them
    model.rotary_emb = RotaryEmbedding(cfg).to(device)
    model.fuse_projections()  # column-parallel shards fuse like whole weights; load_shard fills them
    return model.eval()


def _source(
    name: str, cfg: ModelConfig, layout: ParallelLayout, t: int
) -> tuple[int, range | None]:
    """``(dim, index range)`` of the checkpoint tensor that parameter ``name`` takes, or
    ``(0, None)`` for a replicated one."""
    module, kind = name.split(".")[-2:]
    d = cfg.head_dim
    heads, kv = layout.heads(t, cfg), layout.kv_heads(t, cfg)
    spans = {
        "q_proj": (0, range(heads.start * d, heads.stop * d)),
        "k_proj": (0, range(kv.start * d, kv.stop * d)),
        "v_proj": (0, range(kv.start * d, kv.stop * d)),
        "gate_proj": (0, layout.intermediate(t, cfg)),
        "up_proj": (0, layout.intermediate(t, cfg)),
        "embed_tokens": (0, layout.vocab(t, cfg.vocab_size)),
        "lm_head": (0, layout.vocab(t, cfg.vocab_size)),
    }
    if kind == "weight":  # the row-parallel biases are replicated
        spans["o_proj"] = (1, range(heads.start * d, heads.stop * d))
        spans["down_proj"] = (1, layout.intermediate(t, cfg))
    return spans.get(module, (0, None))


def load_shard(
    model: CausalLM,
    reader: CheckpointReader,
    cfg: ModelConfig,
    layout: ParallelLayout,
    rank: int,
    dtype: torch.dtype,
    progress: StoreProgress,
) -> None:
    """Read each parameter's slice straight from the safetensors files (never a whole copy).

    ``cfg`` is the full model's config (``model.config`` holds the shard's)."""
    _, t = layout.coords(rank)
    order = {n: i for i, n in enumerate(reader.names())}
    params = dict(model.named_parameters())
    progress.start(len(params))

    def ckpt_name(name: str) -> str:
        if name == "lm_head.weight" and name not in reader and cfg.tie_word_embeddings:
            return "model.embed_tokens.weight"
        return name

    for name in sorted(params, key=lambda n: order.get(ckpt_name(n), -1)):
        param, src = params[name], ckpt_name(name)
        if src not in reader:
            raise ModelLoadError(f"missing tensor {src} in checkpoint {reader.model_dir}")
        dim, span = _source(name, cfg, layout, t)
        if span is None:
            value = reader.get(src)
        else:
            value = reader.get_slice(src, dim, span.start, span.stop)
        if value.shape[0] < param.shape[0] and dim == 0 and span is not None:
            # The last vocabulary slice: zero rows up to the common shard size.
            pad = value.new_zeros(param.shape[0] - value.shape[0], *value.shape[1:])
            value = torch.cat([value, pad])
        if tuple(value.shape) != tuple(param.shape):
            raise ModelLoadError(
                f"shape mismatch for tensor {src}: rank {rank}'s slice is {list(value.shape)}, "
                f"the shard expects {list(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(value.to(dtype))
        progress.tick()
