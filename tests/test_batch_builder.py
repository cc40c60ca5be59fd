"""One step's inputs built once for every runner, and the attention backend chosen at load."""

from __future__ import annotations

import torch

from edgeinfer.daemon.engine.attention_backend import (
    AttentionBackend,
    CpuAttention,
    attention_backend,
)
from edgeinfer.daemon.engine.batch_builder import BatchBuilder
from edgeinfer.daemon.engine.kv_cache import KVLayout
from edgeinfer.daemon.engine.sampler import SamplingState
from edgeinfer.daemon.engine.sampling_params import SamplingParams
from edgeinfer.daemon.engine.scheduler import ScheduledBatch
from edgeinfer.daemon.engine.sequence import Sequence

BS = 4


def _layout(dtype: torch.dtype = torch.float32, heads: int = 2, dim: int = 64) -> KVLayout:
    return KVLayout(num_layers=1, block_size=BS, num_kv_heads=heads, head_dim=dim, dtype=dtype)


def _seq(rid: str, tokens: list[int], computed: int, blocks: list[int]) -> Sequence:
    params = SamplingParams()
    seq = Sequence(rid, list(tokens), params, SamplingState(params))
    seq.num_computed_tokens = computed
    seq.block_table = blocks
    return seq


def test_backend_is_chosen_by_device() -> None:
    assert isinstance(attention_backend(torch.device("cpu"), _layout()), CpuAttention)
    meta = attention_backend(torch.device("meta"), _layout())
    assert type(meta) is AttentionBackend  # every other device: the portable one


def test_decodes_first_shortest_context_first_then_prefill_chunks() -> None:
    # a decodes at position 9 (3 blocks), b at position 5, c prefills 3 prompt tokens of 6.
    a = _seq("a", list(range(100, 110)), 9, [7, 3, 8])
    b = _seq("b", list(range(200, 206)), 5, [1, 2])
    c = _seq("c", list(range(300, 306)), 0, [5, 6])
    batch = ScheduledBatch(entries=[(a, 1), (c, 3), (b, 1)])
    builder = BatchBuilder(
        BS, attention_backend(torch.device("cpu"), _layout()), torch.device("cpu")
    )
    step = builder.build(batch)

    assert step.input_ids.tolist() == [205, 109, 300, 301, 302]
    assert step.positions.tolist() == [5, 9, 0, 1, 2]
    # slot = block * BS + offset: b's position 5 is in block 2 (table[1]), a's 9 in 8.
    assert step.meta.slot_mapping.tolist() == [2 * BS + 1, 8 * BS + 1, 20, 21, 22]
    assert step.samplers == [b, a]  # c's chunk ends before its prompt does: no token yet
    assert step.logits_indices.tolist() == [0, 1]
    assert step.max_position == 9
    meta = step.meta
    assert meta.num_decode_tokens == 2
    assert meta.decode_context_lens is not None and meta.decode_context_lens.tolist() == [6, 10]
    assert meta.decode_block_tables is not None
    assert meta.decode_block_tables.tolist() == [[1, 2, 0], [7, 3, 8]]  # padded to the widest
    # CPU: every layer's decode attention is planned once here (in place, or a torch plan).
    assert meta.decode_in_place or meta.decode_plan is not None
    [seg] = meta.prefills
    assert (seg.start, seg.length, seg.start_pos) == (2, 3, 0)
    assert seg.block_table.tolist() == [5]


def test_the_portable_backend_plans_nothing() -> None:
    a = _seq("a", [1, 2, 3], 2, [0])
    step = BatchBuilder(BS, AttentionBackend(), torch.device("cpu")).build(
        ScheduledBatch(entries=[(a, 1)])
    )
    assert not step.meta.decode_in_place and step.meta.decode_plan is None
    assert step.samplers == [a] and step.input_ids.tolist() == [3]
