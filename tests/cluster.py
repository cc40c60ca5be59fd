"""Real daemon and router processes on 127.0.0.1 for end-to-end tests (killed by pid)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

from edgeinfer.shared import processes
from edgeinfer.shared.processes import ChildProcess as Proc
from edgeinfer.shared.processes import free_port

__all__ = ["Cluster", "Proc", "cluster", "free_port", "http_get", "metric", "wait_healthy"]


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    status, body = processes.http_get(url, timeout)
    return status, body.decode()


def wait_healthy(proc: Proc, timeout: float = 90.0, path: str = "/health") -> None:
    proc.wait_http(path, timeout)


class Cluster:
    """Starts processes and guarantees they are killed, whatever the test does."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[Proc] = []

    def daemon(self, name: str, model: Path, *args: str, env: dict[str, str] | None = None) -> Proc:
        ports = {"http": free_port(), "kv": free_port(), "hb": free_port()}
        cmd = [
            sys.executable, "-m", "edgeinfer.daemon.main",
            "--model", str(model), "--host", "127.0.0.1",
            "--port", str(ports["http"]), "--kv-port", str(ports["kv"]),
            *args,
        ]  # fmt: skip
        extra = {
            "EDGEINFER_HEARTBEAT_PORT": str(ports["hb"]),
            "EDGEINFER_NUM_KV_BLOCKS": "256",
            "EDGEINFER_NUM_THREADS": "1",
            "EDGEINFER_HEARTBEAT_INTERVAL_S": "0.3",
            **(env or {}),
        }
        return self._spawn(name, cmd, extra, f"http://127.0.0.1:{ports['http']}", ports)

    def router(self, name: str, config: Path, port: int) -> Proc:
        cmd = [sys.executable, "-m", "edgeinfer.router.main", "--config", str(config)]
        return self._spawn(name, cmd, {}, f"http://127.0.0.1:{port}", {"http": port})

    def _spawn(
        self, name: str, cmd: list[str], extra: dict[str, str], url: str, ports: dict[str, int]
    ) -> Proc:
        proc = processes.spawn(name, cmd, workdir=self.workdir, url=url, env=extra, ports=ports)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()


@contextlib.contextmanager
def cluster(workdir: Path) -> Iterator[Cluster]:
    c = Cluster(workdir)
    try:
        yield c
    finally:
        c.close()


def metric(url: str, name: str, labels: str = "") -> float:
    """Sum of a Prometheus sample from ``url``/metrics (``labels`` filters, e.g. 'direction="received"')."""
    total = 0.0
    for line in http_get(url + "/metrics")[1].splitlines():
        if line.startswith(name) and (not labels or labels in line):
            head, _, value = line.rpartition(" ")
            if head.split("{")[0] == name:
                total += float(value)
    return total
