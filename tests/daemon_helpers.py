"""Shared helpers for the daemon's HTTP tests: a small engine, an app around it, SSE parsing."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

import orjson
from aiohttp import ClientResponse, web
from aiohttp.test_utils import TestClient

from edgeinfer.daemon.app import build_app
from edgeinfer.daemon.config import DaemonConfig
from edgeinfer.daemon.engine.config import EngineConfig
from edgeinfer.daemon.engine.llm_engine import LLMEngine
from edgeinfer.daemon.engine.outputs import EngineStats
from edgeinfer.daemon.engine.tiny_checkpoint import build_tiny_checkpoint
from edgeinfer.daemon.state import STATE_KEY
from edgeinfer.shared.processes import free_port

# Small enough to allocate instantly, large enough for every test's prompts and outputs.
NUM_KV_BLOCKS = 64
MAX_MODEL_LEN = 512

AppClient = TestClient[web.Request, web.Application]


def build_checkpoint(root: Path) -> Path:
    return build_tiny_checkpoint(root / "tiny-llama", architecture="LlamaForCausalLM")


def daemon_config(checkpoint: Path, **overrides: Any) -> DaemonConfig:
    base = DaemonConfig(
        model=str(checkpoint),
        served_model_name="tiny-test",
        num_kv_blocks=NUM_KV_BLOCKS,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=8,
        device="cpu",
        host="127.0.0.1",
        # The ZeroMQ sockets bind too: give each app its own ports.
        kv_port=free_port(),
        heartbeat_port=free_port(),
    )
    return dataclasses.replace(base, **overrides)


def load_engine(checkpoint: Path) -> LLMEngine:
    return LLMEngine(daemon_config(checkpoint).to_engine_config())


def reference_engine(checkpoint: Path) -> LLMEngine:
    """A second engine, never touched by an app, for expected outputs."""
    return LLMEngine(EngineConfig(model=str(checkpoint), num_kv_blocks=NUM_KV_BLOCKS, device="cpu"))


async def start(aiohttp_client: Any, config: DaemonConfig, engine: LLMEngine | None) -> AppClient:
    """An app for ``config`` around ``engine``, with its model loaded (or failed to load)."""
    app = build_app(config, engine=engine)
    client: AppClient = await aiohttp_client(app)
    await asyncio.wait_for(app[STATE_KEY].settled.wait(), 30)
    return client


async def engine_stats(client: AppClient) -> EngineStats:
    engine = client.app[STATE_KEY].engine
    if engine is None:
        raise RuntimeError("the app has no engine")
    return await engine.call(lambda e: e.stats())


async def wait_for_idle_engine(client: AppClient, timeout: float = 5.0) -> EngineStats:
    """Poll until no request runs or waits and no KV block is held; returns those stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await engine_stats(client)
        idle = stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_blocks_used == 0
        if idle or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.02)


async def read_event(resp: ClientResponse) -> dict[str, Any] | str | None:
    """The next SSE event: the decoded JSON, the string "[DONE]", or None at end of stream."""
    while True:
        line = await resp.content.readline()
        if not line:
            return None
        line = line.strip()
        if not line:
            continue
        if not line.startswith(b"data: "):
            raise AssertionError(f"not an SSE data line: {line!r}")
        payload = line[len(b"data: ") :]
        return "[DONE]" if payload == b"[DONE]" else orjson.loads(payload)


async def read_events(resp: ClientResponse) -> list[dict[str, Any] | str]:
    events = []
    while (event := await read_event(resp)) is not None:
        events.append(event)
    return events
