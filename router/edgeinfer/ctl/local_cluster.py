"""A whole edgeinfer network on 127.0.0.1: daemons per PoP and one ``edge-router`` in front.

Every process is a real ``edge-daemon`` / ``edge-router`` started as ``python -m``, each in its
own session, so a Ctrl-C in the terminal reaches only us and :meth:`LocalCluster.stop` decides
the order: the router first (it stops taking requests and lets streams finish), then decode
daemons, then prefill daemons (a decode daemon may still be fetching KV from them). Each gets
one SIGTERM and ``stop_timeout_s`` to exit before SIGKILL. Logs go to ``workdir/<name>.log``.

Nothing here imports the engine: the daemons load their models in their own processes.
"""

from __future__ import annotations

import json
import secrets
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from edgeinfer.ctl.client import RouterClientError
from edgeinfer.shared.processes import ChildExited, ChildProcess, free_port, http_get, spawn

# The MaxMind test database of the source tree: it locates a few hundred networks, enough to
# play client on three continents through X-Forwarded-For. Absent from an installed package.
TEST_GEOIP_DB = Path(__file__).resolve().parents[3] / "tests/data/geoip/GeoIP2-City-Test.mmdb"
# Daemons and router agree: prompts over this many tokens are prefilled in the prefill PoP,
# shorter ones where they are decoded (low, so a chat with a system prompt shows both PoPs).
LOCAL_PREFILL_MAX_TOKENS = 32


@dataclass(frozen=True)
class PopSpec:
    name: str
    lat: float
    lon: float
    roles: tuple[str, ...]  # one daemon per entry: "prefill", "decode" or "both"


# One prefill PoP between two decode PoPs an ocean apart.
DEFAULT_LAYOUT = (
    PopSpec("fra", 50.11, 8.68, ("prefill",)),
    PopSpec("lhr", 51.51, -0.13, ("decode",)),
    PopSpec("sea", 47.61, -122.33, ("decode",)),
)


__all__ = ["DEFAULT_LAYOUT", "TEST_GEOIP_DB", "LocalCluster", "PopSpec", "free_port"]


@dataclass
class LocalCluster:
    workdir: Path
    token: str
    model: str | None = None  # None: the daemons' built-in model
    layout: tuple[PopSpec, ...] = DEFAULT_LAYOUT
    router_port: int = 8080
    geoip_db: Path | None = None
    router_log_level: str = "info"
    kv_cache_bytes: int = 128 << 20  # per daemon; the engine default (1 GiB) is for servers
    stop_timeout_s: float = 20.0
    # The key the router presents to its daemons (their api_key): only it may use them.
    daemon_key: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    procs: list[ChildProcess] = field(default_factory=list)
    roles: dict[str, str] = field(default_factory=dict)  # process name -> "router" or daemon role

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    @property
    def router(self) -> ChildProcess:
        return next(p for p in self.procs if self.roles[p.name] == "router")

    def start(self) -> None:
        """Spawn every daemon and the router; :meth:`wait_ready` says when they serve."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        token_file = self.workdir / "admin-token"
        token_file.write_text(self.token + "\n")
        token_file.chmod(0o600)
        key_file = self.workdir / "daemon-key"
        key_file.touch(0o600)  # never readable by others, not even between two calls
        key_file.chmod(0o600)
        key_file.write_text(self.daemon_key + "\n")
        members: dict[str, list[str]] = {}
        for pop in self.layout:
            for i, role in enumerate(pop.roles):
                proc = self._daemon(f"{pop.name}-{role}-{i}", pop.name, role)
                members.setdefault(pop.name, []).append(proc.url)
        config = self._router_config(members, token_file, key_file)
        cmd = [sys.executable, "-m", "edgeinfer.router.main", "--config", str(config)]
        self._spawn("router", "router", self.router_url, cmd, {})

    def _daemon(self, name: str, pop: str, role: str) -> ChildProcess:
        port, kv_port, hb_port = free_port(), free_port(), free_port()
        cmd = [sys.executable, "-m", "edgeinfer.daemon.main", "--host", "127.0.0.1",
               "--port", str(port), "--kv-port", str(kv_port), "--pop", pop, "--role", role,
               "--local-prefill-threshold", str(LOCAL_PREFILL_MAX_TOKENS)]  # fmt: skip
        if self.model is not None:
            cmd += ["--model", self.model]
        env = {
            "EDGEINFER_HEARTBEAT_PORT": str(hb_port),
            "EDGEINFER_HEARTBEAT_INTERVAL_S": "1.0",
            "EDGEINFER_ADMIN_TOKEN": self.token,
            "EDGEINFER_API_KEY": self.daemon_key,
            "EDGEINFER_KV_CACHE_BYTES": str(self.kv_cache_bytes),
            # Several daemons share a laptop's cores: one torch thread each.
            "EDGEINFER_NUM_THREADS": "1",
        }
        return self._spawn(name, role, f"http://127.0.0.1:{port}", cmd, env)

    def _router_config(
        self, members: dict[str, list[str]], token_file: Path, key_file: Path
    ) -> Path:
        here = next(p.name for p in self.layout if "prefill" in p.roles)
        lines = ["[router]", f'listen = "127.0.0.1:{self.router_port}"', f'here = "{here}"',
                 f'admin_token_file = "{token_file}"', f'daemon_api_key_file = "{key_file}"',
                 f'log_level = "{self.router_log_level}"',
                 "heartbeat_interval_s = 1.0", "discovery_interval_s = 0.5"]  # fmt: skip
        if self.geoip_db is not None:
            # Clients on this machine may claim any address: that is how you play one.
            lines += [f'geoip_db = "{self.geoip_db}"', 'trusted_proxies = ["127.0.0.1/32"]']
        for pop in self.layout:
            urls = ", ".join(json.dumps(u) for u in members[pop.name])
            lines += ["", "[[pop]]", f'name = "{pop.name}"', f"lat = {pop.lat}",
                      f"lon = {pop.lon}", f"daemons = [{urls}]"]  # fmt: skip
        path = self.workdir / "router.toml"
        path.write_text("\n".join(lines) + "\n")
        return path

    def _spawn(
        self, name: str, role: str, url: str, cmd: list[str], env: dict[str, str]
    ) -> ChildProcess:
        proc = spawn(name, cmd, workdir=self.workdir, url=url, env=env)
        self.procs.append(proc)
        self.roles[name] = role
        return proc

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Until the router places on every daemon; raises if a process dies or time runs out."""
        deadline = time.monotonic() + timeout_s
        daemons = sum(len(p.roles) for p in self.layout)
        states: list[str] = []
        while time.monotonic() < deadline:
            try:
                for proc in self.procs:
                    proc.check_alive()
            except ChildExited as e:
                raise RouterClientError(str(e)) from None
            try:
                status, body = http_get(self.router_url + "/admin/pops", 2, self.token)
            except OSError:
                status, body = 0, b""
            if status == 200:
                states = [d["state"] for p in json.loads(body)["pops"] for d in p["daemons"]]
                if states.count("up") == daemons:
                    return
            time.sleep(0.5)
        raise RouterClientError(f"the cluster was not up after {timeout_s:g}s: daemons {states}")

    def stop(self) -> dict[str, int]:
        """Stop everything (router, decode side, prefill side); each process's exit status."""
        order = {"router": 0, "decode": 1, "both": 1, "prefill": 2}
        codes: dict[str, int] = {}
        for rank in sorted(set(order.values())):
            group = [p for p in self.procs if order[self.roles[p.name]] == rank]
            for proc in group:  # the whole rank gets SIGTERM before any is waited for
                proc.send_signal(signal.SIGTERM)
            for proc in group:
                codes[proc.name] = proc.stop(self.stop_timeout_s, term_sent=True)
        return codes
