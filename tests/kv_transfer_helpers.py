"""Shared setup for KV-transfer tests: tiny bf16 engines, a prefill server and a decode client."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgeinfer.daemon.engine.async_engine import AsyncEngine
from edgeinfer.daemon.engine.config import EngineConfig
from edgeinfer.daemon.engine.llm_engine import LLMEngine
from edgeinfer.daemon.engine.sampling_params import SamplingParams
from edgeinfer.daemon.engine.tiny_checkpoint import build_tiny_checkpoint
from edgeinfer.daemon.kv_transfer.decode_client import ClientCurve, RemotePrefillClient
from edgeinfer.daemon.kv_transfer.messages import WireLayout
from edgeinfer.daemon.kv_transfer.prefill_server import PrefillServer, ServerCurve
from edgeinfer.daemon.kv_transfer.stats import TransferStats

NUM_LAYERS = 4  # more than one layer group per chunk when chunk_bytes is small
BLOCK_SIZE = 16
# K or V of one block of one layer: block_size x 2 kv heads x head_dim 16 x 2 bytes (bf16).
PAGE_BYTES = BLOCK_SIZE * 2 * 16 * 2
LAYOUT = WireLayout("bfloat16", BLOCK_SIZE, NUM_LAYERS, num_kv_heads=2, head_dim=16)
GREEDY = SamplingParams.greedy_params(max_tokens=6, ignore_eos=True)
ANY_PORT = "tcp://127.0.0.1:*"


def build_checkpoint(root: Path) -> Path:
    return build_tiny_checkpoint(root / "llama", num_layers=NUM_LAYERS)


def engine_config(checkpoint: Path) -> EngineConfig:
    # A small step budget splits a 200-token prompt into several prefill chunks, so blocks are
    # pushed while later chunks still compute.
    return EngineConfig(
        model=str(checkpoint), dtype="bfloat16", num_kv_blocks=64, max_num_batched_tokens=64
    )


def prompt_of(length: int, offset: int = 0) -> list[int]:
    return [3 + (offset + 7 * i) % 500 for i in range(length)]


def kv_bytes(num_blocks: int) -> int:
    """Payload bytes that carry ``num_blocks`` blocks: K and V of every layer."""
    return num_blocks * NUM_LAYERS * 2 * PAGE_BYTES


@dataclass
class Pair:
    prefill: AsyncEngine
    decode: AsyncEngine
    server: PrefillServer
    client: RemotePrefillClient

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def decode_blocks_used(self) -> int:
        return self.decode.engine.stats().kv_blocks_used

    def prefill_blocks_used(self) -> int:
        return self.prefill.engine.stats().kv_blocks_used


async def start_engine(checkpoint: Path) -> AsyncEngine:
    engine = AsyncEngine(LLMEngine(engine_config(checkpoint)))
    engine.start()
    return engine


@contextlib.asynccontextmanager
async def running_pair(
    checkpoint: Path,
    *,
    timeout_s: float = 5.0,
    server_curve: ServerCurve | None = None,
    client_curve: ClientCurve | None = None,
    chunk_bytes: int = 4 * PAGE_BYTES,  # 2 blocks x 1 layer, or 1 block x 2 layers
    **server_options: Any,
) -> AsyncIterator[Pair]:
    """``server_options``: more keyword arguments of :class:`PrefillServer`."""
    prefill, decode = await start_engine(checkpoint), await start_engine(checkpoint)
    server = PrefillServer(
        prefill,
        ANY_PORT,
        curve=server_curve,
        stats=TransferStats(),
        chunk_bytes=chunk_bytes,
        **server_options,
    )
    await server.start()
    client = RemotePrefillClient(
        decode, curve=client_curve, stats=TransferStats(), timeout_s=timeout_s
    )
    try:
        yield Pair(prefill, decode, server, client)
    finally:
        await client.close()
        await server.stop(drain=False)
        await prefill.stop()
        await decode.stop()


async def remote_generate(
    pair: Pair, rid: str, prompt: Sequence[int], params: SamplingParams = GREEDY
) -> list[int]:
    """Prefill remotely, decode locally; all tokens, as a daemon's request runner would."""
    stream = pair.decode.open_stream(rid)
    try:
        first = await pair.client.prefill(rid, prompt, params, pair.endpoint)
        tokens = list(first.new_token_ids)
        if not first.finished:
            async for out in pair.decode.iterate(stream):
                tokens.extend(out.new_token_ids)
        return tokens
    finally:
        pair.decode.close_stream(rid)


def reference_tokens(
    checkpoint: Path, prompts: Sequence[Sequence[int]], params: SamplingParams = GREEDY
) -> list[list[int]]:
    """Tokens from one engine doing everything, the prompts run one after the other."""
    engine = LLMEngine(engine_config(checkpoint))
    return [engine.generate([p], params)[0].token_ids for p in prompts]
