"""Zero-copy conversion between KV-cache tensors and wire payload buffers.

The wire layer is torch-free and names dtypes as strings; bfloat16 has no numpy dtype, so pages
travel as raw bytes and are reinterpreted here: a page ``[n, block_size, Hkv, D]`` of any dtype
is sent as a flat ``uint8`` view of the same memory and rebuilt with ``torch.frombuffer`` over
the received ZeroMQ frame, so neither side copies the page outside the engine's own
``index_select`` (export) and ``index_copy_`` (import).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from edgeinfer.daemon.engine.kv_cache import KVLayout
from edgeinfer.daemon.kv_transfer.messages import WireLayout

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a KV-cache dtype; ValueError for one the protocol cannot carry."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        raise ValueError(f"KV dtype {dtype} cannot be sent; use one of {sorted(TORCH_DTYPES)}")
    return name


def wire_layout(layout: KVLayout) -> WireLayout:
    return WireLayout(
        dtype_name(layout.dtype),
        layout.block_size,
        layout.num_layers,
        layout.num_kv_heads,
        layout.head_dim,
    )


def layout_mismatch(ours: WireLayout, theirs: WireLayout) -> str | None:
    """Why pages of ``ours`` cannot be written into a cache of ``theirs``; None if they can."""
    for name in ("dtype", "block_size", "num_layers", "num_kv_heads", "head_dim"):
        mine, peer = getattr(ours, name), getattr(theirs, name)
        if mine != peer:
            return f"{name}: prefill has {mine}, decode has {peer}"
    return None


def page_shape(layout: WireLayout, num_blocks: int) -> tuple[int, int, int, int]:
    """Shape of ``num_blocks`` pages of one layer, K or V: ``[n, block_size, Hkv, D]``."""
    return (num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)


def page_bytes(layout: WireLayout) -> int:
    """Bytes of one block of one layer, K or V."""
    itemsize = torch.empty((), dtype=TORCH_DTYPES[layout.dtype]).element_size()
    return layout.block_size * layout.num_kv_heads * layout.head_dim * itemsize


def tensor_payload(tensor: torch.Tensor) -> memoryview:
    """A flat byte view of a CPU tensor's memory, for ``send_multipart(copy=False)``.

    The view holds a reference to a numpy array that holds the tensor, so the memory lives as
    long as libzmq needs it. ``contiguous()`` is a no-op for exported pages and the slices
    of them that the server sends.
    """
    flat = tensor.detach().contiguous().view(torch.uint8).reshape(-1)
    return flat.numpy().data


def payload_tensor(buf: memoryview, dtype: str, shape: Sequence[int]) -> torch.Tensor:
    """A tensor of ``shape`` aliasing ``buf`` (a received frame), reinterpreted as ``dtype``.

    The frame is read-only; torch warns that it cannot mark tensors read-only. The tensor is
    only ever read (copied into the cache by ``import_kv``), so the warning is silenced.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        flat = torch.frombuffer(buf, dtype=TORCH_DTYPES[dtype])
    return flat.view(*shape)
