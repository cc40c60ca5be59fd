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


def test_decode_threads_pass_through() -> None:
    assert DaemonConfig(device="cpu").to_engine_config().decode_threads is None  # = num_threads
    assert DaemonConfig(device="cpu", decode_threads=1).to_engine_config().decode_threads == 1


def test_decode_threads_are_validated() -> None:
    from edgeinfer.daemon.engine.config import EngineConfig
    from edgeinfer.daemon.engine.errors import EngineError

    with pytest.raises(EngineError, match="decode_threads must be >= 1"):
        EngineConfig(decode_threads=0)


def test_port_0_is_any_free_port_and_may_repeat() -> None:
    config = DaemonConfig(port=0, kv_port=0, heartbeat_port=0)
    assert (config.port, config.kv_port, config.heartbeat_port) == (0, 0, 0)
    DaemonConfig(port=0, kv_port=0, heartbeat_port=7000)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"heartbeat_port": -1}, r"'heartbeat_port' must be in \[0, 65535\]"),
        ({"kv_port": 65536}, r"'kv_port' must be in \[0, 65535\]"),
        ({"port": 0, "kv_port": 7000, "heartbeat_port": 7000}, "must differ"),
    ],
)
def test_bad_ports(overrides: dict[str, int], needle: str) -> None:
    from edgeinfer.shared.errors import ConfigError

    with pytest.raises(ConfigError, match=needle):
        DaemonConfig(**overrides)  # type: ignore[arg-type]
