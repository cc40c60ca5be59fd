"""All device code in one place: builds the model, owns the KV cache, runs a step.

The runner turns a :class:`ScheduledBatch` into flat input tensors (:mod:`batch_builder`),
runs the model, whose layers attend with the backend chosen here at load
(:mod:`attention_backend`), and returns the logits of the sequences that sample this step.
On CUDA, pure-decode steps replay captured CUDA graphs (see :mod:`cuda_graphs`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from edgeinfer.daemon.engine.attention_backend import attention_backend
from edgeinfer.daemon.engine.batch_builder import BatchBuilder
from edgeinfer.daemon.engine.checkpoint import CheckpointReader, load_weights
from edgeinfer.daemon.engine.compressed_weights import keep_layers_compressed
from edgeinfer.daemon.engine.config import EngineConfig
from edgeinfer.daemon.engine.fused_decode import FusedDecode
from edgeinfer.daemon.engine.kernel_trials import choose_fused, choose_kernels, release_panels
from edgeinfer.daemon.engine.kv_cache import KVCache, KVLayout, num_blocks_for_budget
from edgeinfer.daemon.engine.linear import linear
from edgeinfer.daemon.engine.model import CausalLM
from edgeinfer.daemon.engine.model_config import ModelConfig
from edgeinfer.daemon.engine.rope import RotaryEmbedding
from edgeinfer.daemon.engine.scheduler import ScheduledBatch
from edgeinfer.daemon.engine.sequence import Sequence
from edgeinfer.daemon.engine.thread_binding import bind_omp_team
from edgeinfer.daemon.engine.trial_set import Sizes

log = logging.getLogger(__name__)


def _skip_tensor(name: str) -> bool:
    return name.endswith("rotary_emb.inv_freq")


@torch.inference_mode()
def _warm_up_packed(model: CausalLM, max_rows: int, threads: int) -> None:
    """Run every packed weight shape once per decode batch size (1..``max_rows`` rows).

    oneDNN builds a matmul primitive (JIT code) the first time it meets an (input rows,
    weight shape, threads) combination: ~0.5 ms per projection shape, so a step at a batch size
    not seen before ran several ms slower, and every batch size a server passes through pays it
    once. Layers share shapes, so this is five shapes, not every layer (0.15 s for the tiny
    preset, 0.8 s for SmolLM2, at 64 rows). Prefill chunks have too many sizes to build ahead;
    their matmuls are long enough that the one-off cost hardly shows.
    """
    shapes = {(w.shape[0], w.shape[1], w.dtype): w for w in model.packed_weights()}
    if not shapes:
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for (_, features, dtype), weight in shapes.items():
            x = torch.zeros(max_rows, features, dtype=dtype)
            for rows in range(1, max_rows + 1):
                linear(x[:rows], weight)
    finally:
        torch.set_num_threads(before)


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, model_dir: Path) -> None:
        self.device = torch.device(cfg.device)
        self.dtype = cfg.resolve_dtype(model_cfg)
        self.model_cfg = model_cfg
        self.block_size = cfg.block_size
        # torch intra-op threads per step kind (CPU): (decode-only steps, steps with prefill).
        every = cfg.num_threads or torch.get_num_threads()
        self._threads = (cfg.decode_threads or every, every)
        self._bind_threads = cfg.bind_threads
        # The most threads a step may use for now (None: no cap); AsyncEngine.lend_cores.
        self.thread_cap: int | None = None
        self.model = self._load(model_cfg, model_dir, cfg)
        self.layout = KVLayout(
            num_layers=model_cfg.num_layers,
            block_size=cfg.block_size,
            num_kv_heads=model_cfg.num_kv_heads,
            head_dim=model_cfg.head_dim,
            dtype=self.dtype,
        )
        num_blocks = cfg.num_kv_blocks or min(
            num_blocks_for_budget(self.layout, cfg.kv_cache_bytes),
            # More blocks than every sequence at full context (twice over, for the prefix
            # cache) is memory a small model would never touch; zeroing it costs start-up time.
            2 * cfg.max_num_seqs * -(-cfg.resolve_max_model_len(model_cfg) // cfg.block_size),
        )
        self.kv_cache = KVCache(self.layout, num_blocks, self.device)
        attention = attention_backend(self.device, self.layout)
        self.model.use_attention(attention)
        if self.device.type == "cpu":
            # Small decode steps run the layer stack in one compiled call where it fits and
            # where it beat the layers op by op on this host.
            fused = None
            if not cfg.enforce_eager:
                fused = FusedDecode.of(list(self.model.model.layers), self.kv_cache)
            if fused is not None:
                choose_fused(self.model, fused, self.kv_cache, self._sizes(cfg), self._threads[0])
            release_panels(self.model, fused)
            self.model.fused_decode = fused
        self.batches = BatchBuilder(cfg.block_size, attention, self.device)
        self.graphs = None
        # Per-layer decoding swaps parameter storage in hooks, which a captured graph cannot see.
        eager = cfg.enforce_eager or cfg.compressed_weights == "per_layer"
        if self.device.type == "cuda" and not eager:
            from edgeinfer.daemon.engine.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(
                self, max_batch=cfg.max_num_seqs, max_model_len=cfg.resolve_max_model_len(model_cfg)
            )

    def _load(self, model_cfg: ModelConfig, model_dir: Path, cfg: EngineConfig) -> CausalLM:
        # Build on the meta device so no time goes into random init we would overwrite.
        with torch.device("meta"):
            model = CausalLM(model_cfg)
        model = model.to_empty(device=self.device).to(self.dtype)
        if model_cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight  # to_empty unties them
        model.rotary_emb = RotaryEmbedding(model_cfg).to(self.device)
        # Before loading: the parameters become views of the fused weights and load into them.
        model.fuse_projections()
        optional = {"lm_head.weight"} if model_cfg.tie_word_embeddings else set()
        with CheckpointReader(model_dir) as reader:
            kept: set[str] = set()
            if cfg.compressed_weights == "per_layer":
                kept = keep_layers_compressed(model, reader, self.dtype, self.device)
            load_weights(
                model,
                reader,
                name_map=lambda n: None if _skip_tensor(n) or n in kept else n,
                dtype=self.dtype,
                show_progress=cfg.show_progress,
                optional=optional | kept,
            )
        if cfg.compressed_weights != "per_layer":
            model.pack_weights()
            _warm_up_packed(model, cfg.max_num_seqs, threads=self._threads[0])
        if self.device.type == "cpu":
            # Each compiled kernel against the library call it replaces, on this model's shapes:
            # it runs only where it won here (timed once per host, then cached).
            choose_kernels(model, self._sizes(cfg), self._threads)
        return model.eval()

    def _sizes(self, cfg: EngineConfig) -> Sizes:
        max_tokens = min(cfg.max_num_batched_tokens, cfg.resolve_max_model_len(self.model_cfg))
        return Sizes(self.dtype, cfg.block_size, cfg.max_num_seqs, max_tokens)

    def check_health(self) -> None:
        """Nothing to check: a single-process runner has no worker that could die."""

    def bind_threads(self) -> list[int] | None:
        """Bind the calling thread's torch threads, one per CPU (the thread that steps calls
        it: :mod:`~edgeinfer.daemon.engine.thread_binding` says when it binds); the CPUs, or
        None where nothing was bound."""
        if self.device.type != "cpu" or not self._bind_threads:
            return None
        threads = max(self._threads)
        cpus = bind_omp_team(threads)
        if cpus is not None:
            log.info("torch threads of the engine thread bound to CPUs %s", cpus)
        return cpus

    # ---- one step -------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Sequence]]:
        """Run the model on a batch; returns float32 logits ``[N + P, vocab]``: ``N`` samplers'
        rows, then ``P`` rows of the prompt positions whose logprobs were asked for."""
        step = self.batches.build(batch)
        meta, samplers = step.meta, step.samplers
        if self.device.type == "cpu":
            threads = min(self._threads[bool(meta.prefills)], self.thread_cap or 1 << 16)
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
        # Only partial prefill chunks asking no prompt logprobs have no rows: then the LM head
        # is skipped entirely. Graphs compute the samplers' rows only.
        graphed = len(step.logits_indices) == len(samplers) and not meta.prefills
        if self.graphs is not None and graphed and self.graphs.can_run(len(samplers)):
            logits = self.graphs.run(step)
        else:
            logits = self.model(
                step.input_ids,
                step.positions,
                meta,
                self.kv_cache,
                step.logits_indices,
                step.max_position,
            )
        return logits, samplers

    @torch.inference_mode()
    def prompt_logits(self, seq: Sequence) -> torch.Tensor:
        """Logits ``[T, vocab]`` for every position of ``seq`` (blocks already allocated)."""
        batch = ScheduledBatch(entries=[(seq, seq.num_tokens)])
        step = self.batches.build(batch)
        return self.model(
            step.input_ids, step.positions, step.meta, self.kv_cache, None, step.max_position
        )
