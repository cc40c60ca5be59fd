"""Real daemon and router processes on 127.0.0.1 for end-to-end tests (killed by pid)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    url: str
    ports: dict[str, int] = field(default_factory=dict)

    @property
    def kv_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.ports['kv']}"

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(10)

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


def wait_healthy(proc: Proc, timeout: float = 90.0, path: str = "/health") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited {proc.popen.returncode}:\n{proc.output()}")
        with contextlib.suppress(OSError):
            if http_get(proc.url + path, timeout=2)[0] == 200:
                return
        time.sleep(0.2)
    raise TimeoutError(f"{proc.name} not healthy after {timeout}s:\n{proc.output()}")


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
        log = self.workdir / f"{name}.log"
        env = {**os.environ, **extra, "PYTHONUNBUFFERED": "1"}
        with log.open("wb") as out:
            popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        proc = Proc(name, popen, log, url, ports)
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
