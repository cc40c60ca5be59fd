"""The router's settings: :class:`RouterConfig` (the ``[router]`` table) and the ``[[pop]]`` list.

The two are loaded separately because they change at different times: ``RouterConfig`` is read
once at start-up through the layered :func:`load_config`, while the PoP list is re-read on every
SIGHUP (:func:`load_pops`) so an operator can add or remove PoPs without dropping streams. An
array of tables has no sensible ``EDGEINFER_*`` form, so it lives outside the layered loader.
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yarl

from edgeinfer.router.network import NetworkModel
from edgeinfer.router.pop_registry import PopConfig
from edgeinfer.router.selector import PlacementConfig
from edgeinfer.shared.config import load_config
from edgeinfer.shared.errors import ConfigError
from edgeinfer.shared.logs import LogFormat

LogLevel = Literal["debug", "info", "warning", "error"]

CONFIG_SECTION = "router"
_POP_KEYS = ("name", "lat", "lon", "daemons")


@dataclass(frozen=True)
class RouterConfig:
    # ---- where ----
    listen: str = "0.0.0.0:8080"
    here: str = "local"  # the PoP this router runs in: RTT origin and the geo fallback
    geoip_db: Path | None = None  # a MaxMind .mmdb; without it every client is placed "here"
    trusted_proxies: tuple[str, ...] = ()  # CIDRs whose X-Forwarded-For is believed
    admin_token_file: Path | None = None  # without it the admin API refuses every request
    # ---- the public endpoint ----
    # TOML [[key]] entries (tenant, sha256 of the key, limits); without it no key is needed.
    api_keys_file: Path | None = None
    # Where request/token windows live: "memory://" (this process) or "redis://host:port"
    # (shared by the routers of a region).
    rate_limit_storage: str = "memory://"
    # false: each tenant's prompts are salted apart in every daemon's prefix cache.
    share_prefix_cache_across_tenants: bool = False
    daemon_api_key_file: Path | None = None  # the key daemons require (their `api_key`)
    max_body_bytes: int = 16 << 20  # equal to the daemon's, so the daemon judges prompt length
    cors_allowed_origins: tuple[str, ...] = ()  # browser origins allowed to call /v1/*
    log_level: LogLevel = "info"
    log_format: LogFormat = "text"  # text | kv | json: one line per event either way
    # ---- placement ----
    # Defaults are PlacementConfig's, so each lives in one place.
    itl_slo_s: float = PlacementConfig.itl_slo_s  # decode daemons expected to exceed it lose
    # false: placement ignores what the daemons' prefix caches hold (the prefix-blind
    # selector), e.g. to measure what prefix-aware placement gains.
    prefix_aware_placement: bool = True
    # Further placements tried when a daemon could not be reached or answered 503; a daemon
    # that accepted a request is never replaced (the generation would run twice).
    max_retries: int = 2
    # ---- upstream timeouts ----
    connect_timeout_s: float = 2.0
    # From arrival to the last byte, streams included: the only limit before a daemon's
    # response headers (a non-streaming answer arrives whole, at the end). A dead daemon is
    # noticed sooner, by its closed connection or its stopped heartbeats.
    request_timeout_s: float = 600.0
    read_timeout_s: float = 60.0  # longest silence tolerated inside an SSE stream
    # ---- membership ----
    heartbeat_interval_s: float = 5.0  # what the daemons use; staleness is judged against it
    discovery_interval_s: float = 2.0  # retry period for daemons whose /v1/state did not answer
    rtt_probe_interval_s: float = 10.0
    # Clients within this distance of `here` are priced with max(fibre floor, measured RTT);
    # 0 turns measured RTTs off (pure geography).
    catchment_km: float = NetworkModel.catchment_km
    # ---- operations ----
    shutdown_timeout_s: float = 30.0  # how long SIGTERM lets in-flight streams finish
    pool_limit: int = 1000  # upstream connections kept open, over all daemons

    def __post_init__(self) -> None:
        self.listen_address()  # validates
        if not self.here:
            raise ConfigError("config key 'here' must name this router's PoP")
        for cidr in self.trusted_proxies:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError as e:
                raise ConfigError(f"config key 'trusted_proxies': {cidr!r}: {e}") from e
        for name in (
            "itl_slo_s",
            "connect_timeout_s",
            "request_timeout_s",
            "read_timeout_s",
            "heartbeat_interval_s",
            "discovery_interval_s",
            "rtt_probe_interval_s",
            "shutdown_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config key '{name}' must be > 0, got {getattr(self, name)}")
        for name in ("max_retries",):
            if getattr(self, name) < 0:
                raise ConfigError(f"config key '{name}' must be >= 0, got {getattr(self, name)}")
        for name in ("pool_limit", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"config key '{name}' must be >= 1, got {getattr(self, name)}")
        for origin in self.cors_allowed_origins:
            url = yarl.URL(origin)
            if origin != "*" and (
                url.scheme not in ("http", "https") or not url.host or str(url.origin()) != origin
            ):
                raise ConfigError(
                    f"config key 'cors_allowed_origins': {origin!r} is not '*' or an origin "
                    "like 'https://app.example.com' (scheme, host, optional port, no path)"
                )

    def listen_address(self) -> tuple[str, int]:
        """``"host:port"`` (``"[::]:8080"`` for IPv6) split into host and port."""
        host, sep, port = self.listen.rpartition(":")
        host = host.removeprefix("[").removesuffix("]")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ConfigError(f"config key 'listen' must be HOST:PORT, got {self.listen!r}")
        return host, int(port)

    def read_admin_token(self) -> str | None:
        """The admin bearer token, or None when no token file is configured."""
        if self.admin_token_file is None:
            return None
        try:
            token = self.admin_token_file.read_text().strip()
        except OSError as e:
            raise ConfigError(
                f"cannot read admin_token_file {self.admin_token_file}: {e.strerror or e}"
            ) from e
        if not token:
            raise ConfigError(f"admin_token_file {self.admin_token_file} is empty")
        return token


def load_router_config(
    toml_path: Path | None,
    *,
    env: Mapping[str, str] = os.environ,
    overrides: Mapping[str, Any] | None = None,
) -> RouterConfig:
    return load_config(
        RouterConfig, toml_path=toml_path, section=CONFIG_SECTION, env=env, overrides=overrides
    )


def load_pops(toml_path: Path, here: str) -> tuple[PopConfig, ...]:
    """Parse every ``[[pop]]`` table of ``toml_path``; ``here`` must be one of them."""
    try:
        with toml_path.open("rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config file {toml_path}: {e.strerror or e}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"invalid TOML in {toml_path}: {e}") from e
    tables = data.get("pop", [])
    if not isinstance(tables, list) or not tables:
        raise ConfigError(f"{toml_path} needs at least one [[pop]] table")
    pops = tuple(_parse_pop(t, f"{toml_path} [[pop]] #{i + 1}") for i, t in enumerate(tables))
    _check_unique(pops, toml_path)
    if here not in {p.name for p in pops}:
        raise ConfigError(f"config key 'here' = {here!r} is not a [[pop]] in {toml_path}")
    return pops


def _parse_pop(table: Any, where: str) -> PopConfig:
    if not isinstance(table, dict):
        raise ConfigError(f"{where} must be a table")
    for key in table:
        if key not in _POP_KEYS:
            close = difflib.get_close_matches(key, _POP_KEYS, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"unknown key '{key}' in {where}{hint}")
    missing = [k for k in _POP_KEYS if k not in table]
    if missing:
        raise ConfigError(f"{where} is missing {', '.join(repr(k) for k in missing)}")
    name = table["name"]
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}: 'name' must be a non-empty string")
    lat = _coordinate(table["lat"], 90.0, f"{where} ({name}) 'lat'")
    lon = _coordinate(table["lon"], 180.0, f"{where} ({name}) 'lon'")
    daemons = table["daemons"]
    if not isinstance(daemons, list) or not all(isinstance(d, str) for d in daemons):
        raise ConfigError(f"{where} ({name}): 'daemons' must be a list of URLs")
    return PopConfig(
        name=name, lat=lat, lon=lon, daemons=tuple(_daemon_url(d, where) for d in daemons)
    )


def _coordinate(raw: Any, bound: float, what: str) -> float:
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw):
        raise ConfigError(f"{what} must be a number, got {raw!r}")
    if not -bound <= raw <= bound:
        raise ConfigError(f"{what} must be in [-{bound:g}, {bound:g}], got {raw}")
    return float(raw)


def _daemon_url(raw: str, where: str) -> str:
    """Normalise a daemon's base URL so the same daemon is always the same registry key."""
    url = yarl.URL(raw)
    if url.scheme not in ("http", "https") or not url.host:
        raise ConfigError(f"{where}: daemon {raw!r} is not an http(s)://host:port URL")
    if url.path not in ("", "/") or url.query_string or url.fragment:
        raise ConfigError(f"{where}: daemon {raw!r} must be a base URL without a path")
    return str(url.origin())


def _check_unique(pops: tuple[PopConfig, ...], toml_path: Path) -> None:
    names: set[str] = set()
    owner: dict[str, str] = {}
    for pop in pops:
        if pop.name in names:
            raise ConfigError(f"PoP {pop.name!r} is defined twice in {toml_path}")
        names.add(pop.name)
        for url in pop.daemons:
            if url in owner:
                raise ConfigError(
                    f"daemon {url} is listed twice in {toml_path} "
                    f"(PoPs {owner[url]!r} and {pop.name!r})"
                )
            owner[url] = pop.name
