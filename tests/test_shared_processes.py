"""ChildProcess.stop with a server's two-step exit (first SIGTERM: drain; second: give up)."""

from __future__ import annotations

import signal
import socket
import sys
import time
from pathlib import Path

from edgeinfer.shared import processes
from edgeinfer.shared.processes import free_port, spawn

# Exits 0 half a second after the first SIGTERM, 3 at once on a second one.
TWO_STEP = """
import signal, sys, time
hits = []
def on_term(*_):
    hits.append(1)
    if len(hits) > 1:
        sys.exit(3)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
while not hits:
    time.sleep(0.01)
print("draining", flush=True)
deadline = time.monotonic() + 0.5
while time.monotonic() < deadline:
    time.sleep(0.01)
sys.exit(0)
"""


def _start(tmp_path: Path, name: str):
    proc = spawn(name, [sys.executable, "-c", TWO_STEP], workdir=tmp_path, url="http://unused")
    _wait_for(proc, "ready")
    return proc


def _wait_for(proc, word: str) -> None:
    deadline = time.monotonic() + 10
    while word not in proc.output() and time.monotonic() < deadline:
        time.sleep(0.02)


def test_stop_after_the_callers_own_sigterm_only_waits(tmp_path: Path) -> None:
    proc = _start(tmp_path, "waited")
    proc.send_signal(signal.SIGTERM)
    _wait_for(proc, "draining")  # the first signal was handled: a second would cut it short
    assert proc.stop(timeout_s=10, term_sent=True) == 0


def test_stop_sends_sigterm_itself_by_default(tmp_path: Path) -> None:
    proc = _start(tmp_path, "plain")
    assert proc.stop(timeout_s=10) == 0


def test_free_port_never_hands_out_a_port_twice() -> None:
    # The kernel readily gives a just-released port to the next bind-to-0; a daemon handed the
    # same port twice (HTTP and heartbeat) refuses its own configuration.
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)


def test_free_port_is_no_port_a_bind_to_zero_can_take() -> None:
    # A test's aiohttp server binds port 0 after the daemon's ZeroMQ ports were handed out;
    # drawn from the kernel's ephemeral range, one of them could be that server's port.
    low = processes._ephemeral_range()[0]
    assert all(processes._LOWEST <= free_port() < low for _ in range(50))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        assert s.getsockname()[1] >= low
