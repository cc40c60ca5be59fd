"""Engine settings. The daemon's config embeds these; defaults live here only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from edgeinfer.daemon.engine.errors import EngineError
from edgeinfer.daemon.engine.model_config import ModelConfig
from edgeinfer.kernels.cpu_features import native_bf16

DType = Literal["auto", "float32", "bfloat16", "float16"]
# How a compressed checkpoint's weights are held: decoded once while loading, or kept compressed
# on the device with each decoder layer decoded just before it runs (see compressed_weights.py).
CompressedWeights = Literal["decompress_at_load", "per_layer"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # a directory, "tiny", or None for the built-in default model
    dtype: DType = "auto"
    device: str = "auto"  # "auto" picks cuda when present
    block_size: int = 16
    kv_cache_bytes: int = 1 << 30
    num_kv_blocks: int | None = None  # overrides the byte budget (tests, benchmarks)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # The most prompt tokens a step may prefill while it also decodes (chunked prefill only;
    # 0: max_num_batched_tokens). A step's time grows with its prefill tokens and every
    # decoding stream waits for the step: the cap bounds that stall (Sarathi-Serve's
    # stall-free batching), and arrivals that land together get their first tokens in turn
    # instead of all after the longest combined step. 256: on a 2-core EPYC (SmolLM2 bf16,
    # 8 streams of 64-384-token prompts) it served 267-282 tok/s against 252-257 at 512 and
    # 266 at 128 (chunks of 256 rows keep a projection's activations in cache), and each
    # stall is half as long.
    max_prefill_tokens_with_decodes: int = 256
    max_model_len: int | None = None  # None: the model's max_position_embeddings, capped
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    enforce_eager: bool = False
    show_progress: bool | None = None  # None: only on a terminal
    num_threads: int | None = None  # torch intra-op threads on the CPU
    # Threads for steps that only decode (memory-bound on the CPU); None: num_threads. Fewer
    # can leave a core to other work on the host while prefill steps still use every core.
    decode_threads: int | None = None
    # Bind the stepping thread's torch threads one per CPU when they are as many as the CPUs
    # this process may use (engine/thread_binding.py); off for hosts shared some other way.
    bind_threads: bool = True
    compressed_weights: CompressedWeights = "decompress_at_load"
    # tensor_parallel x pipeline_parallel ranks, one process (and GPU) each; see
    # engine/parallel. Above 1 x 1, kv_cache_bytes is each rank's budget.
    tensor_parallel: int = 1
    pipeline_parallel: int = 1

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise EngineError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise EngineError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.block_size:
            raise EngineError(
                f"max_num_batched_tokens must be >= block_size ({self.block_size}), "
                f"got {self.max_num_batched_tokens}"
            )
        if self.max_prefill_tokens_with_decodes < 0:
            raise EngineError(
                "max_prefill_tokens_with_decodes must be >= 0, "
                f"got {self.max_prefill_tokens_with_decodes}"
            )
        for name in ("tensor_parallel", "pipeline_parallel"):
            if getattr(self, name) < 1:
                raise EngineError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_threads", "decode_threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise EngineError(f"{name} must be >= 1, got {value}")
        if self.dtype not in ("auto", *_DTYPES):
            raise EngineError(f"dtype must be auto|float32|bfloat16|float16, got {self.dtype!r}")
        if self.compressed_weights not in ("decompress_at_load", "per_layer"):
            raise EngineError(
                "compressed_weights must be decompress_at_load|per_layer, "
                f"got {self.compressed_weights!r}"
            )
        if self.device == "auto":
            object.__setattr__(self, "device", "cuda" if torch.cuda.is_available() else "cpu")

    def resolve_dtype(self, model_cfg: ModelConfig) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if torch.device(self.device).type == "cpu":
            # A bf16 checkpoint runs in bf16 where the CPU has bf16 dot products (as vLLM's CPU
            # backend does): half the bytes per decode step, 2x the prefill matmul rate. Other
            # CPUs emulate half precision slowly, so there (and for other checkpoints) float32,
            # which is also transformers' CPU default.
            if model_cfg.torch_dtype == "bfloat16" and native_bf16():
                return torch.bfloat16
            return torch.float32
        return _DTYPES.get(model_cfg.torch_dtype or "bfloat16", torch.bfloat16)

    def resolve_max_model_len(self, model_cfg: ModelConfig) -> int:
        if self.max_model_len is not None:
            return min(self.max_model_len, model_cfg.max_position_embeddings)
        return min(model_cfg.max_position_embeddings, 32768)
