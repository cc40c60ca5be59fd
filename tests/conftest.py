"""Fixtures the in-process daemon API tests share; a test module overrides any of them by
defining its own (a different config, a checkpoint of its own shape)."""

from __future__ import annotations

import os

import torch

# Without a GPU, Triton's kernels run on CPU tensors under its interpreter, which is chosen when
# triton is first imported (the imports below import it): choose it here, so that a plain
# `pytest` runs the Triton tests as `make test` does, whatever order the modules load in.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from daemon_helpers import build_checkpoint, daemon_config, load_engine, start, wait_for_idle_engine
from edgeinfer.daemon.engine.llm_engine import LLMEngine


def pytest_sessionstart(session: pytest.Session) -> None:
    """The router's compiled placement passes are compiled (or loaded from their disk cache)
    once, before any test starts router processes that would each compile them."""
    from edgeinfer.router.selector import warm

    warm()


@pytest.fixture(scope="module")
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny test checkpoint, built once per test module."""
    return build_checkpoint(tmp_path_factory.mktemp(request.module.__name__))


@pytest.fixture(scope="module")
def llm(checkpoint: Path) -> LLMEngine:
    """One loaded engine per test module, shared by its daemons."""
    return load_engine(checkpoint)


@pytest_asyncio.fixture
async def client(aiohttp_client: Any, checkpoint: Path, llm: LLMEngine) -> AsyncIterator[Any]:
    """A daemon app around the module's engine. Every test must leave the shared engine as it
    found it: nothing running, no block held."""
    client = await start(aiohttp_client, daemon_config(checkpoint), llm)
    yield client
    stats = await wait_for_idle_engine(client)
    assert stats.kv_blocks_used == 0 and stats.num_running == 0
