"""The edge daemon's settings: one frozen dataclass, filled by :func:`load_daemon_config`.

Engine sizing fields take their defaults from :class:`EngineConfig` itself so that a default
lives in exactly one place; :meth:`DaemonConfig.to_engine_config` hands them back.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from edgeinfer.daemon.engine.config import CompressedWeights, DType, EngineConfig
from edgeinfer.daemon.engine.default_model import DEFAULT_MODEL
from edgeinfer.daemon.engine.errors import EngineError
from edgeinfer.shared.config import load_config
from edgeinfer.shared.errors import ConfigError
from edgeinfer.shared.logs import LogFormat

Role = Literal["both", "prefill", "decode"]
LogLevel = Literal["debug", "info", "warning", "error"]

# ZeroMQ transports a prefill peer may be reached over; anything else is a typo.
_PEER_SCHEMES = ("tcp://", "ipc://", "inproc://")

CONFIG_SECTION = "daemon"
# The tool-call formats the API reads (edgeinfer.daemon.api.tool_parsers).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")


@dataclass(frozen=True)
class DaemonConfig:
    # ---- what to serve ----
    model: str | None = None  # a checkpoint directory, "tiny", or None for the built-in model
    served_model_name: str | None = None  # the name clients send; default: the model spec
    # hermes | llama3_json | mistral; None: the format the chat template shows (else hermes)
    tool_call_parser: str | None = None
    dtype: DType = "auto"
    role: Role = "both"
    # ---- where ----
    host: str = "0.0.0.0"
    # Port 0 is any free port: the daemon binds before loading and reports the port it got.
    port: int = 8000
    kv_port: int = 5600
    heartbeat_port: int = 5601  # ZeroMQ PUB socket routers subscribe to
    # The address peers and routers use to reach this daemon's ZeroMQ sockets; None: the
    # bind host, or this machine's name when binding to every interface.
    advertise_host: str | None = None
    pop: str = "local"  # the point of presence this daemon runs in, reported to the router
    log_level: LogLevel = "info"
    log_format: LogFormat = "text"  # text | kv | json: one line per event either way
    # ---- disaggregation ----
    prefill_peers: tuple[str, ...] = ()  # ZeroMQ endpoints of prefill daemons
    # Prompts shorter than this many tokens are prefilled locally even when a peer is known:
    # shipping their KV costs more than computing it.
    local_prefill_threshold: int = 512
    kv_timeout_s: float = 10.0
    heartbeat_interval_s: float = 5.0
    curve_secret_key: Path | None = None  # this daemon's .key_secret file
    curve_server_public_key: Path | None = None  # the prefill peers' .key file (decode side)
    curve_allowed_clients_dir: Path | None = None  # public keys of allowed decode daemons
    # ---- operations ----
    admin_token: str | None = None  # when set, /admin/* needs "Authorization: Bearer <token>"
    # When set, /v1/* needs "Authorization: Bearer <api_key>" (the router's daemon key), and
    # only such requests may steer the daemon through x-edge-* headers.
    api_key: str | None = None
    drain_timeout_s: float = 30.0  # how long SIGTERM waits for in-flight requests
    # Most of the wall clock spent admitting bodies over 1 MiB (read, JSON, length check):
    # a flood of huge posts then takes at most this share of a core from the streams.
    large_body_share: float = 0.25
    # ---- engine sizing (defaults are EngineConfig's) ----
    device: str = EngineConfig.device
    kv_cache_bytes: int = EngineConfig.kv_cache_bytes
    num_kv_blocks: int | None = EngineConfig.num_kv_blocks
    max_num_seqs: int = EngineConfig.max_num_seqs
    max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens
    max_prefill_tokens_with_decodes: int = EngineConfig.max_prefill_tokens_with_decodes
    block_size: int = EngineConfig.block_size
    max_model_len: int | None = EngineConfig.max_model_len
    enable_prefix_caching: bool = EngineConfig.enable_prefix_caching
    num_threads: int | None = EngineConfig.num_threads
    decode_threads: int | None = EngineConfig.decode_threads
    bind_threads: bool = EngineConfig.bind_threads
    compressed_weights: CompressedWeights = EngineConfig.compressed_weights
    tensor_parallel: int = EngineConfig.tensor_parallel  # worker processes: tp x pp ranks
    pipeline_parallel: int = EngineConfig.pipeline_parallel

    def __post_init__(self) -> None:
        for name in ("port", "kv_port", "heartbeat_port"):
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                raise ConfigError(
                    f"config key '{name}' must be in [0, 65535] (0: any free port), got {value}"
                )
        ports = {"port": self.port, "kv_port": self.kv_port, "heartbeat_port": self.heartbeat_port}
        fixed = [p for p in ports.values() if p != 0]
        if len(set(fixed)) != len(fixed):
            raise ConfigError(f"port, kv_port and heartbeat_port must differ, got {ports}")
        for name in ("kv_timeout_s", "heartbeat_interval_s", "drain_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config key '{name}' must be > 0, got {getattr(self, name)}")
        if not 0 < self.large_body_share <= 1:
            raise ConfigError(
                f"config key 'large_body_share' must be in (0, 1], got {self.large_body_share}"
            )
        if self.local_prefill_threshold < 0:
            raise ConfigError(
                f"config key 'local_prefill_threshold' must be >= 0, "
                f"got {self.local_prefill_threshold}"
            )
        for peer in self.prefill_peers:
            if not peer.startswith(_PEER_SCHEMES):
                raise ConfigError(
                    f"config key 'prefill_peers': {peer!r} is not a ZeroMQ endpoint "
                    "(expected tcp://host:port)"
                )
        if self.curve_server_public_key is not None and self.curve_secret_key is None:
            raise ConfigError(
                "config key 'curve_server_public_key' needs 'curve_secret_key' too: "
                "a CURVE client must hold its own key pair"
            )
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ConfigError(
                f"config key 'tool_call_parser' must be one of {TOOL_CALL_PARSERS}, "
                f"got {self.tool_call_parser!r}"
            )
        if self.served_model_name == "":
            raise ConfigError("config key 'served_model_name' must not be empty")

    @property
    def model_name(self) -> str:
        """The name the OpenAI API reports and accepts (vLLM's rule: the model spec itself)."""
        return self.served_model_name or self.model or DEFAULT_MODEL

    @property
    def public_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        if self.host in ("0.0.0.0", "::", ""):
            return socket.getfqdn()
        return self.host

    def zmq_bind(self, port: int) -> str:
        host = "*" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"tcp://{host}:{port}"

    @property
    def kv_endpoint(self) -> str:
        """Where decode daemons send prefill requests (advertised in state and heartbeats)."""
        return f"tcp://{self.public_host}:{self.kv_port}"

    @property
    def heartbeat_endpoint(self) -> str:
        return f"tcp://{self.public_host}:{self.heartbeat_port}"

    @property
    def serves_api(self) -> bool:
        """A prefill daemon only computes KV for others; it has no OpenAI API."""
        return self.role != "prefill"

    def engine_threads(self) -> int | None:
        """``num_threads``, or by default on the CPU every core this process may use.

        The event loop (HTTP, SSE, detokenization, ZeroMQ) needs little CPU next to the engine:
        sampled under 8 streams it is idle ~99% of the time. Measured on 2 cores, 8 streams
        (`bench/serving.py --workload c8`, four runs each, after the engine's in-place decode
        attention): 2 torch threads 89-124 output tok/s (median ~102) with TTFT p50 0.38-0.56 s,
        1 thread 97-108 tok/s with TTFT p50 0.62-0.69 s: prefill is compute-bound and wants
        every core. (Before that engine work, 1 thread won: 92 against 69 tok/s.) Parallel
        ranks keep torch's own default.
        """
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.num_threads is not None or torch.device(device).type != "cpu":
            return self.num_threads
        if self.tensor_parallel * self.pipeline_parallel > 1:
            return None
        return len(os.sched_getaffinity(0))

    def to_engine_config(self) -> EngineConfig:
        try:
            return EngineConfig(
                model=self.model,
                dtype=self.dtype,
                device=self.device,
                block_size=self.block_size,
                kv_cache_bytes=self.kv_cache_bytes,
                num_kv_blocks=self.num_kv_blocks,
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_prefill_tokens_with_decodes=self.max_prefill_tokens_with_decodes,
                max_model_len=self.max_model_len,
                enable_prefix_caching=self.enable_prefix_caching,
                num_threads=self.engine_threads(),
                decode_threads=self.decode_threads,
                bind_threads=self.bind_threads,
                compressed_weights=self.compressed_weights,
                tensor_parallel=self.tensor_parallel,
                pipeline_parallel=self.pipeline_parallel,
                # A daemon logs; a progress bar in its journal is noise.
                show_progress=False,
            )
        except EngineError as exc:
            raise ConfigError(f"invalid engine settings: {exc}") from exc


def load_daemon_config(
    toml_path: Path | None = None,
    *,
    env: Mapping[str, str],
    overrides: Mapping[str, Any] | None = None,
) -> DaemonConfig:
    """Defaults < ``[daemon]`` of ``toml_path`` < ``EDGEINFER_*`` in ``env`` < ``overrides``.

    The engine settings are checked here too, so a bad block size fails at start-up with the
    other config errors rather than after the model has loaded.
    """
    config = load_config(
        DaemonConfig,
        toml_path=toml_path,
        section=CONFIG_SECTION,
        env=env,
        overrides=overrides,
    )
    config.to_engine_config()
    return config
