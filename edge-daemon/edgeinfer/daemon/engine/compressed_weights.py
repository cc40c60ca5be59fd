"""Keep decoder-layer weights compressed in device memory and decode each layer just before use.

With ``EngineConfig(compressed_weights="per_layer")`` and a compressed checkpoint, every
bf16/fp16 weight of a decoder layer stays a :class:`CompressedTensor` on the model's device
(about two thirds of its bf16 size). A forward pre-hook on the layer decodes its weights into the
parameters (Triton on CUDA, the numpy decoder on the CPU), and a forward hook empties them again
after the layer ran, so at most one layer is held decoded at a time (its q/k/v and gate/up
weights fused as in a decoded model, see ``FusedProjection``). Embeddings, the LM head and
the final norm are loaded as usual: they are used outside the layers.

Decoding is deterministic and bit-exact, so outputs equal those of ``decompress_at_load``; the
price is one decode of each layer per forward pass.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from edgeinfer.daemon.engine.checkpoint import CheckpointReader
from edgeinfer.daemon.engine.errors import ModelLoadError
from edgeinfer.daemon.engine.model import CausalLM, DecoderLayer
from edgeinfer.kernels.compression.cpu_decoder import decode_many_cpu
from edgeinfer.kernels.compression.format import CompressedTensor
from edgeinfer.kernels.compression.reader import decompress

log = logging.getLogger(__name__)


class _LayerWeights:
    """The compressed weights of one decoder layer and the hooks that swap them in and out."""

    def __init__(
        self,
        layer: DecoderLayer,
        weights: list[tuple[nn.Parameter, CompressedTensor]],
        dtype: torch.dtype,
    ) -> None:
        self.layer = layer
        self.params = [param for param, _ in weights]
        self.packed = [packed for _, packed in weights]
        self.dtype = dtype
        device = self.packed[0].bits.device
        # Parameters point here while the layer is idle, which frees their full-size storage.
        self.empty = torch.empty(0, dtype=dtype, device=device)
        self.release()

    def materialise(self, *_: Any) -> None:
        """Forward pre-hook: decode every weight of the layer into its parameter."""
        if self.packed[0].bits.is_cuda:
            decoded = [decompress(packed) for packed in self.packed]
        else:
            # One lock-step loop for the whole layer amortises numpy's per-call cost.
            decoded = decode_many_cpu(self.packed)
        for param, tensor in zip(self.params, decoded, strict=True):
            param.data = tensor.to(self.dtype)
        # Same fused matmuls as a layer loaded decoded, so the outputs stay bit-identical.
        self.layer.fuse_projections()

    def release(self, *_: Any) -> None:
        """Forward hook (also called at set-up): drop the decoded and the fused weights."""
        for param in self.params:
            param.data = self.empty
        self.layer.unfuse_projections()


def keep_layers_compressed(
    model: CausalLM, reader: CheckpointReader, dtype: torch.dtype, device: torch.device
) -> set[str]:
    """Hold the compressed decoder-layer weights of ``reader`` on ``device`` behind hooks.

    Returns the checkpoint names now served this way, which the normal loader must skip. Tensors
    stored uncompressed (e.g. float32 ones) are left to the normal loader. A checkpoint with no
    compressed tensor returns an empty set, so it simply loads as usual (with a warning).
    """
    handled: set[str] = set()
    # Module names equal checkpoint tensor names (see model.py), so the layer prefix is known.
    for i, layer in enumerate(model.model.layers):
        if not isinstance(layer, DecoderLayer):
            continue
        weights: list[tuple[nn.Parameter, CompressedTensor]] = []
        for local, param in layer.named_parameters():
            name = f"model.layers.{i}.{local}"
            packed = reader.get_compressed(name) if name in reader else None
            if packed is None:
                continue
            if packed.shape != tuple(param.shape):
                raise ModelLoadError(
                    f"shape mismatch for tensor {name}: checkpoint has {list(packed.shape)}, "
                    f"model parameter expects {list(param.shape)}"
                )
            weights.append((param, packed.to(device)))
            handled.add(name)
        if weights:
            hold = _LayerWeights(layer, weights, dtype)
            layer.register_forward_pre_hook(hold.materialise)
            # always_call: a failing forward must not leave the layer decoded for good.
            layer.register_forward_hook(hold.release, always_call=True)
    if not handled:
        log.warning(
            "compressed_weights='per_layer' but %s has no compressed decoder weights; "
            "loading them decoded",
            reader.model_dir,
        )
    return handled
