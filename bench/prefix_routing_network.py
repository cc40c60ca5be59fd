"""The processes of ``bench/prefix_routing.py``: three PoPs of one ``both`` daemon each and a
router in front, on 127.0.0.1 with free ports, started fresh for each setup and stopped by pid.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from edgeinfer.shared.processes import ChildProcess, free_port, http_get, spawn

# A few hundred km apart: the router (and its clients) are in lhr.
POPS = (("lhr", 51.51, -0.13), ("ams", 52.37, 4.90), ("fra", 50.11, 8.68))


def http_post(url: str, body: dict[str, Any], token: str) -> tuple[int, bytes]:
    req = urllib.request.Request(url, orjson.dumps(body), method="POST")
    req.add_header("Authorization", f"Bearer {token}")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@dataclass
class Network:
    router: ChildProcess
    daemons: list[ChildProcess]

    def stop(self) -> None:
        for proc in [self.router, *self.daemons]:
            proc.stop()


def start_network(workdir: Path, args: argparse.Namespace, aware: bool) -> Network:
    workdir.mkdir(parents=True, exist_ok=True)
    key_file, token_file = workdir / "daemon-key", workdir / "admin-token"
    key_file.write_text(args.daemon_key + "\n")
    token_file.write_text(args.admin_token + "\n")
    daemons = []
    model = [] if args.model == "default" else ["--model", args.model]
    for pop, _, _ in POPS:
        port = free_port()
        cmd = [
            sys.executable, "-m", "edgeinfer.daemon.main", *model, "--role", "both",
            "--pop", pop, "--host", "127.0.0.1", "--port", str(port),
            "--kv-port", str(free_port()), "--log-level", "warning",
        ]  # fmt: skip
        env = {
            "EDGEINFER_HEARTBEAT_PORT": str(free_port()),
            "EDGEINFER_HEARTBEAT_INTERVAL_S": "1.0",
            "EDGEINFER_API_KEY": args.daemon_key,
            "EDGEINFER_KV_CACHE_BYTES": str(args.kv_cache_mib << 20),
            # Three daemons share the host's cores: one torch thread each.
            "EDGEINFER_NUM_THREADS": "1",
        }
        daemons.append(spawn(pop, cmd, workdir=workdir, url=f"http://127.0.0.1:{port}", env=env))
    port = free_port()
    lines = [
        "[router]", f'listen = "127.0.0.1:{port}"', f'here = "{POPS[0][0]}"',
        f'daemon_api_key_file = "{key_file}"', f'admin_token_file = "{token_file}"',
        "heartbeat_interval_s = 1.0", "discovery_interval_s = 0.2", "catchment_km = 0.0",
        # The 2-core host decodes far slower than a server: no daemon is an SLO outlier.
        "itl_slo_s = 5.0", 'log_level = "warning"',
        f"prefix_aware_placement = {'true' if aware else 'false'}",
    ]  # fmt: skip
    for (pop, lat, lon), daemon in zip(POPS, daemons, strict=True):
        lines += ["", "[[pop]]", f'name = "{pop}"', f"lat = {lat}", f"lon = {lon}",
                  f'daemons = ["{daemon.url}"]']  # fmt: skip
    config = workdir / "router.toml"
    config.write_text("\n".join(lines) + "\n")
    cmd = [sys.executable, "-m", "edgeinfer.router.main", "--config", str(config)]
    router = spawn("router", cmd, workdir=workdir, url=f"http://127.0.0.1:{port}")
    return Network(router, daemons)


def wait_ready(net: Network, token: str, timeout_s: float = 600.0) -> None:
    """Until every daemon is healthy and the router places on all of them."""
    for daemon in net.daemons:
        daemon.wait_http("/health", timeout_s)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        net.router.check_alive()
        with contextlib.suppress(OSError):
            status, body = http_get(net.router.url + "/admin/pops", 2, token)
            if status == 200:
                pops = orjson.loads(body)["pops"]
                if [d["state"] for p in pops for d in p["daemons"]].count("up") == len(POPS):
                    return
        time.sleep(0.2)
    raise TimeoutError(f"the router did not place on every daemon:\n{net.router.output()}")


def metric(url: str, name: str) -> float:
    """Sum of a Prometheus sample's values (every label set)."""
    body = http_get(url + "/metrics")[1].decode()
    return sum(
        float(line.rpartition(" ")[2])
        for line in body.splitlines()
        if line.startswith(name) and line[len(name)] in " {"
    )


@contextlib.contextmanager
def network(args: argparse.Namespace, setup: str) -> Iterator[Network]:
    net = start_network(Path(tempfile.mkdtemp(prefix=f"prefix-{setup}-")), args, setup == "aware")
    try:
        wait_ready(net, args.admin_token)
        yield net
    finally:
        net.stop()
