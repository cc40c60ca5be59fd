"""Real edge-daemon and edge-router processes under a fake systemd: a unix datagram socket as
NOTIFY_SOCKET, signals sent by pid. No systemctl involved."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cluster import free_port, http_get
from daemon_helpers import build_checkpoint

pytestmark = pytest.mark.slow
DAEMON_ENV = {"EDGEINFER_NUM_KV_BLOCKS": "160", "EDGEINFER_MAX_MODEL_LEN": "2048"}
DAEMON_ENV |= {"EDGEINFER_NUM_THREADS": "1", "EDGEINFER_LOG_FORMAT": "kv"}


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

    def wait_for(self, line: str, timeout: float = 60.0) -> float:
        """The arrival time of the first message holding ``line`` (waits for it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for at, msg in list(self.messages):
                if line in msg.split("\n"):
                    return at
            time.sleep(0.02)
        raise TimeoutError(f"no {line!r} in {[m for _, m in self.messages]}")

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


def spawn(cmd: list[str], workdir: Path, name: str, port: int, env: dict[str, str]) -> Service:
    notify = NotifySocket(workdir / f"{name}.sock")
    log = workdir / f"{name}.log"
    full_env = {**os.environ, **env, "NOTIFY_SOCKET": notify.address, "WATCHDOG_USEC": "400000"}
    with log.open("wb") as out:
        popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env)
    return Service(popen, port, log, notify)


def daemon_cmd(checkpoint: Path, port: int, *args: str) -> list[str]:
    return [
        sys.executable, "-m", "edgeinfer.daemon.main", "--model", str(checkpoint),
        "--host", "127.0.0.1", "--port", str(port), "--kv-port", str(free_port()), *args,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Service]]:
    """Two daemons started together (start-up dominates): "patient" drains for 30 s and reads a
    config file for SIGHUP; "hasty" gives up on in-flight requests after 0.5 s."""
    workdir = tmp_path_factory.mktemp("lifecycle")
    checkpoint = build_checkpoint(workdir)
    config = workdir / "daemon.toml"
    config.write_text('[daemon]\nlog_level = "info"\ndrain_timeout_s = 30\n')
    services: dict[str, Service] = {}
    for name, args, extra in [
        ("patient", ("--config", str(config)), {}),
        ("hasty", (), {"EDGEINFER_DRAIN_TIMEOUT_S": "0.5"}),
    ]:
        port = free_port()
        env = {**DAEMON_ENV, "EDGEINFER_HEARTBEAT_PORT": str(free_port()), **extra}
        services[name] = spawn(daemon_cmd(checkpoint, port, *args), workdir, name, port, env)
    try:
        yield services
    finally:
        for s in services.values():
            if s.popen.poll() is None:
                s.popen.kill()
                s.popen.wait()


def open_stream(port: int, max_tokens: int) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body = {"prompt": "hi", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: {")  # the first token is out: mid-stream now
    return resp


def events(raw: bytes) -> list[str]:
    return [ln[6:] for ln in raw.decode().splitlines() if ln.startswith("data: ")]


def test_daemon_ready_watchdog_sighup_and_sigterm_drain(daemons: dict[str, Service]) -> None:
    d = daemons["patient"]
    ready_at = d.notify.wait_for("READY=1")
    # READY=1 means serving: the model is loaded and the port answers, not merely bound.
    assert http_get(f"http://127.0.0.1:{d.port}/health")[0] == 200
    assert any(s.startswith("STATUS=loading model") for s in d.notify.lines("STATUS="))
    first_status = next(at for at, m in d.notify.messages if m.startswith("STATUS=loading"))
    assert first_status < ready_at
    time.sleep(0.7)
    with pytest.raises(TimeoutError):
        d.notify.wait_for("STOPPING=1", timeout=0.1)
    assert len(d.notify.lines("WATCHDOG=1")) >= 3  # every 0.2 s (WATCHDOG_USEC=0.4 s)

    config = Path(d.popen.args[d.popen.args.index("--config") + 1])  # type: ignore[union-attr]
    config.write_text('[daemon]\nlog_level = "debug"\ndrain_timeout_s = 20\n')
    d.popen.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while "in force now" not in d.output() and time.monotonic() < deadline:
        time.sleep(0.05)
    out = d.output()
    assert "SIGHUP: reloaded log_level: 'info' -> 'debug'" in out
    assert "level=debug" in out  # the new level is live
    assert "not reloaded, restart to apply: drain_timeout_s (30.0 -> 20.0)" in out

    stream = open_stream(d.port, max_tokens=400)  # ~1 s of tokens on this machine
    d.popen.send_signal(signal.SIGTERM)
    d.notify.wait_for("STOPPING=1", timeout=10)
    late = http.client.HTTPConnection("127.0.0.1", d.port, timeout=10)
    late.request("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 2}))
    assert late.getresponse().status == 503  # draining: new work is refused, not queued
    rest = events(stream.read())
    assert rest[-1] == "[DONE]" and not any('"error"' in e for e in rest)
    assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "length"
    assert len(rest) - 1 == 399  # every token after the first, none lost
    assert d.popen.wait(30) == 0, d.output()


def test_daemon_drain_timeout_aborts_with_a_clean_error(daemons: dict[str, Service]) -> None:
    d = daemons["hasty"]
    d.notify.wait_for("READY=1")
    stream = open_stream(d.port, max_tokens=2000)  # ~6 s: far past the 0.5 s drain timeout
    started = time.monotonic()
    d.popen.send_signal(signal.SIGTERM)
    rest = events(stream.read())
    assert time.monotonic() - started < 5
    error = json.loads(rest[-2])["error"]
    assert "drain timeout" in error["message"] and error["type"] == "server_error"
    assert rest[-1] == "[DONE]"
    assert d.popen.wait(30) == 0, d.output()
    assert "drain timeout: aborting 1 requests" in d.output()


def test_router_notify_sighup_and_sigterm(tmp_path: Path) -> None:
    port, dead = free_port(), free_port()
    config = tmp_path / "router.toml"
    pop = '[[pop]]\nname = "{}"\nlat = 0\nlon = 0\ndaemons = ["http://127.0.0.1:{}"]\n'
    head = f'[router]\nlisten = "127.0.0.1:{port}"\nhere = "a"\nlog_format = "kv"\n'
    config.write_text(head + pop.format("a", dead))
    cmd = [sys.executable, "-m", "edgeinfer.router.main", "--config", str(config)]
    r = spawn(cmd, tmp_path, "router", port, {})
    try:
        r.notify.wait_for("READY=1", timeout=30)
        assert http_get(f"http://127.0.0.1:{port}/health")[0] == 503  # listening, no daemons
        config.write_text(
            head.replace("127.0.0.1", "0.0.0.0").replace('"kv"', '"json"')
            + pop.format("a", dead)
            + pop.format("b", free_port())
        )
        r.popen.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "reloaded 2 PoPs" not in r.output() and time.monotonic() < deadline:
            time.sleep(0.05)
        out = r.output()
        assert "not reloaded, restart to apply: listen" in out
        line = next(ln for ln in out.splitlines() if "reloaded 2 PoPs" in ln)
        assert json.loads(line)["level"] == "info"  # the new log format is live
        r.popen.send_signal(signal.SIGINT)  # behaves like SIGTERM: drain, then exit 0
        assert r.popen.wait(30) == 0, r.output()
        assert r.notify.lines("STOPPING=1") and r.notify.lines("WATCHDOG=1")
    finally:
        if r.popen.poll() is None:
            r.popen.kill()


def test_fatal_start_up_errors_have_a_code_and_one_line(tmp_path: Path) -> None:
    """Each fatal start-up error: a documented exit status and one ``error:`` line, last.

    The daemon's configuration errors take the same path as the router's (and are covered
    in-process by test_daemon_process); each daemon process here costs seconds of imports.
    """
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    taken = busy.getsockname()[1]
    bad = tmp_path / "bad.toml"
    bad.write_text('[router]\nlisten = "127.0.0.1:1"\nhree = "a"\n')
    router_ok = tmp_path / "router.toml"
    router_ok.write_text(
        f'[router]\nlisten = "127.0.0.1:{taken}"\nhere = "a"\n'
        '[[pop]]\nname = "a"\nlat = 0\nlon = 0\ndaemons = []\n'
    )
    router = [sys.executable, "-m", "edgeinfer.router.main", "--config"]
    cases = {
        "daemon port in use": (daemon_cmd(tmp_path / "none", taken), 1, "cannot listen on"),
        "daemon no model": (daemon_cmd(tmp_path / "none", free_port()), 1, "cannot load model"),
        "router bad key": ([*router, str(bad)], 2, "unknown config key 'hree'"),
        "router port in use": ([*router, str(router_ok)], 1, f"cannot listen on 127.0.0.1:{taken}"),
    }  # fmt: skip
    env = {**os.environ, **DAEMON_ENV, "EDGEINFER_HEARTBEAT_PORT": str(free_port())}
    procs = {
        name: subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for name, (cmd, _, _) in cases.items()
    }
    try:
        for name, (_, code, needle) in cases.items():
            _, err = procs[name].communicate(timeout=60)
            last = err.decode().strip().splitlines()[-1]
            assert procs[name].returncode == code, (name, err.decode())
            assert last.startswith("edge-") and ": error: " in last and needle in last, name
    finally:
        busy.close()
        for p in procs.values():
            if p.poll() is None:
                p.kill()
