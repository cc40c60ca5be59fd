"""Real daemon and router processes under a fake systemd: a unix datagram socket as
NOTIFY_SOCKET, signals sent by pid, output in a log file. No systemctl involved."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# A hang guard, not a speed assumption: each wait ends at its event, long before this.
EVENT_TIMEOUT_S = 120.0


def wait_until(condition: Callable[[], bool], what: str, timeout: float = EVENT_TIMEOUT_S) -> None:
    """Poll ``condition`` until it holds; AssertionError naming ``what`` if it never does."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


class NotifySocket:
    """Stands in for systemd: a thread collects every datagram sent to ``address`` at once, as
    systemd does (a full queue would drop watchdog pings)."""

    def __init__(self, path: Path) -> None:
        self.address = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.address)
        self.messages: list[tuple[float, str]] = []
        threading.Thread(target=self._collect, daemon=True).start()

    def _collect(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                msg = self.sock.recv(4096).decode()
                self.messages.append((time.monotonic(), msg))

    def wait_for(self, line: str, timeout: float = EVENT_TIMEOUT_S, count: int = 1) -> float:
        """The arrival time of the ``count``-th message holding ``line`` (waits for it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            arrivals = [at for at, msg in list(self.messages) if line in msg.split("\n")]
            if len(arrivals) >= count:
                return arrivals[count - 1]
            time.sleep(0.01)
        raise TimeoutError(f"no {line!r} x{count} in {[m for _, m in self.messages]}")

    def lines(self, prefix: str) -> list[str]:
        return [ln for _, m in list(self.messages) for ln in m.split("\n") if ln.startswith(prefix)]


@dataclass
class Service:
    popen: subprocess.Popen[bytes]
    port: int
    log: Path
    notify: NotifySocket

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_output(self, pattern: str) -> re.Match[str]:
        """The first match of the regex ``pattern`` in the output (waits for it)."""
        found: list[re.Match[str]] = []

        def seen() -> bool:
            if self.popen.poll() is not None:
                raise AssertionError(f"exited {self.popen.returncode}:\n{self.output()}")
            match = re.search(pattern, self.output())
            found.extend([match] if match else [])
            return bool(found)

        wait_until(seen, f"{pattern!r} in the output")
        return found[0]

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()


def spawn(
    cmd: list[str], workdir: Path, name: str, port: int, env: dict[str, str] | None = None
) -> Service:
    notify = NotifySocket(workdir / f"{name}.sock")
    log = workdir / f"{name}.log"
    full_env = {**os.environ, **(env or {}), "NOTIFY_SOCKET": notify.address}
    full_env.setdefault("WATCHDOG_USEC", "400000")
    with log.open("wb") as out:
        popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env)
    return Service(popen, port, log, notify)


def daemon_cmd(model: str | Path | None, *args: str, launcher: Path | None = None) -> list[str]:
    """``edge-daemon`` on 127.0.0.1; ``launcher``: a script that runs it (a test hook)."""
    if launcher is None:
        head = [sys.executable, "-m", "edgeinfer.daemon.main"]
    else:
        head = [sys.executable, str(launcher)]
    model_args = ["--model", str(model)] if model is not None else []
    return [*head, *model_args, "--host", "127.0.0.1", *args]


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has installed a handler for ``signum`` (its SigCgt mask)."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("SigCgt:")), 16)
    return bool(mask >> (signum - 1) & 1)
