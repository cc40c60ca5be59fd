"""Child processes of a local edgeinfer network: spawn with a log file, wait for health, stop.

``edgectl cluster up``, the demo, the end-to-end tests and the serving benchmarks all run real
``edge-daemon`` / ``edge-router`` (or vLLM) processes on 127.0.0.1. They share this one way of
doing it: each child runs in its own session (a Ctrl-C in the terminal reaches only the parent,
and :meth:`ChildProcess.stop` can signal the whole group, e.g. vLLM's forked engine), writes
stdout and stderr to ``workdir/<name>.log``, and is waited on by polling an HTTP path.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# Ports free_port has handed out in this process (it never hands one out twice).
_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()
# Where free_port looks when the kernel's ephemeral range cannot be read (Linux's default).
_EPHEMERAL_DEFAULT = (32768, 60999)
_LOWEST = 10000  # below: ports that services commonly take


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel gives to binds to port 0 and to outgoing connections."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return _EPHEMERAL_DEFAULT


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now, never handed out before by this process.

    It is drawn below the kernel's ephemeral range: a port taken from that range (a bind to
    port 0) is free again once the probe closes, and before its caller binds it the kernel could
    hand it to anyone's bind to 0 or outgoing connection, e.g. an aiohttp test server beside a
    daemon whose ZeroMQ port it is. Where no such room exists, a bind to port 0 it is."""
    low = _ephemeral_range()[0]
    rng = random.Random()
    with _handed_out_lock:
        for _ in range(256):
            if low - 1 > _LOWEST:
                port = rng.randint(_LOWEST, low - 1)
                if port in _handed_out:
                    continue
                with socket.socket() as s:
                    try:
                        s.bind((host, port))
                    except OSError:
                        continue
            else:
                with socket.socket() as s:
                    s.bind((host, 0))
                    port = int(s.getsockname()[1])
                if port in _handed_out:
                    continue
            _handed_out.add(port)
            return port
    raise RuntimeError("no fresh free port after 256 tries")


def http_get(url: str, timeout: float = 5.0, token: str | None = None) -> tuple[int, bytes]:
    """(status, body) of a GET; an HTTP error status is returned, not raised."""
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


class ChildExited(RuntimeError):
    """A child process exited while we were waiting for it."""


@dataclass
class ChildProcess:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    url: str  # its HTTP base URL
    ports: dict[str, int] = field(default_factory=dict)  # what else it listens on, by name

    @property
    def pid(self) -> int:
        return self.popen.pid

    def tcp_endpoint(self, port: str) -> str:
        """``tcp://127.0.0.1:<port>`` for one of its named ports (a ZeroMQ endpoint)."""
        return f"tcp://127.0.0.1:{self.ports[port]}"

    def running(self) -> bool:
        return self.popen.poll() is None

    def output(self, chars: int = 4000) -> str:
        """The end of its log."""
        return self.log.read_text(errors="replace")[-chars:]

    def check_alive(self) -> None:
        if not self.running():
            raise ChildExited(
                f"{self.name} exited with status {self.popen.returncode}; "
                f"its log ({self.log}) ends:\n{self.output(2000)}"
            )

    def send_signal(self, sig: int, group: bool = False) -> None:
        """Signal it (or its whole process group) if it still runs; do not wait."""
        if self.running():
            with contextlib.suppress(ProcessLookupError):
                if group:
                    os.killpg(self.pid, sig)
                else:
                    os.kill(self.pid, sig)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to this process only (not its group) and reap it if it exits."""
        self.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)

    def stop(self, timeout_s: float = 20.0, group: bool = False, *, term_sent: bool = False) -> int:
        """SIGTERM, up to ``timeout_s`` to exit, then SIGKILL; its exit status.

        ``group`` signals the whole process group, for children that fork helpers of their own.
        ``term_sent``: the caller already sent SIGTERM, so only wait: a second SIGTERM means
        "stop waiting" to a server with a two-step exit, and may land after its handler is gone.
        """
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if not self.running():
                break
            if not (term_sent and sig == signal.SIGTERM):
                self.send_signal(sig, group)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout_s)
        return self.popen.wait()

    def wait_http(self, path: str = "/health", timeout_s: float = 90.0) -> None:
        """Until ``GET url+path`` answers 200; raises if the process exits or time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            with contextlib.suppress(OSError):
                if http_get(self.url + path, timeout=2)[0] == 200:
                    return
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not healthy after {timeout_s:g}s:\n{self.output()}")


def spawn(
    name: str,
    cmd: Sequence[str],
    *,
    workdir: Path,
    url: str,
    env: Mapping[str, str] | None = None,
    ports: Mapping[str, int] | None = None,
) -> ChildProcess:
    """Start ``cmd`` in its own session with output to ``workdir/<name>.log``."""
    log = workdir / f"{name}.log"
    with log.open("wb") as out:
        popen = subprocess.Popen(
            list(cmd),
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
    return ChildProcess(name, popen, log, url, dict(ports or {}))
