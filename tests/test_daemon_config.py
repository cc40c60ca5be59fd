"""DaemonConfig's derived engine settings."""

from __future__ import annotations

import os

import pytest

from edgeinfer.daemon.config import DaemonConfig


def test_cpu_engine_threads_use_every_core_by_default() -> None:
    cores = len(os.sched_getaffinity(0))
    assert DaemonConfig(device="cpu").engine_threads() == cores
    assert DaemonConfig(device="cpu").to_engine_config().num_threads == cores


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"device": "cpu", "num_threads": 3}, 3),  # an explicit setting wins
        ({"device": "cpu", "tensor_parallel": 2}, None),  # ranks split the host themselves
        ({"device": "cuda"}, None),  # torch's default drives no GPU work
    ],
)
def test_engine_threads_otherwise(overrides: dict[str, object], expected: int | None) -> None:
    assert DaemonConfig(**overrides).engine_threads() == expected  # type: ignore[arg-type]


def test_decode_only_steps_leave_the_event_loop_a_core_by_default() -> None:
    cores = len(os.sched_getaffinity(0))
    engine = DaemonConfig(device="cpu").to_engine_config()
    assert engine.decode_threads == max(cores - 1, 1)
    assert DaemonConfig(device="cpu", num_threads=4).engine_decode_threads() == 3
    assert DaemonConfig(device="cpu", num_threads=1).engine_decode_threads() == 1
    assert DaemonConfig(device="cpu", decode_threads=2).engine_decode_threads() == 2
    assert DaemonConfig(device="cuda").engine_decode_threads() is None


def test_decode_threads_are_validated() -> None:
    from edgeinfer.daemon.engine.config import EngineConfig
    from edgeinfer.daemon.engine.errors import EngineError

    with pytest.raises(EngineError, match="decode_threads must be >= 1"):
        EngineConfig(decode_threads=0)
