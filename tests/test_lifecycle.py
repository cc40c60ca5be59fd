"""Real edge-daemon and edge-router processes under a fake systemd: a unix datagram socket as
NOTIFY_SOCKET, signals sent by pid. No systemctl involved."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster import free_port, http_get
from daemon_helpers import build_checkpoint
from service_helpers import EVENT_TIMEOUT_S, Service, daemon_cmd, spawn

pytestmark = pytest.mark.slow
MAX_MODEL_LEN = 2048
DAEMON_ENV = {"EDGEINFER_NUM_KV_BLOCKS": "160", "EDGEINFER_MAX_MODEL_LEN": str(MAX_MODEL_LEN)}
DAEMON_ENV |= {"EDGEINFER_NUM_THREADS": "1", "EDGEINFER_LOG_FORMAT": "kv"}
# The longest generation the daemons allow after a short prompt. The drain tests need a stream
# still running when the daemon handles SIGTERM and the test's next request: each checks that
# it was (a STATUS line, the token count) rather than trusting this host to be slow enough.
LONGEST = MAX_MODEL_LEN - 48


def start_daemon(checkpoint: Path, workdir: Path, name: str, *args: str, **env: str) -> Service:
    port = free_port()
    ports = ("--port", str(port), "--kv-port", "0", "--heartbeat-port", "0")
    cmd = daemon_cmd(checkpoint, *ports, *args)
    return spawn(cmd, workdir, name, port, {**DAEMON_ENV, **env})


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Service]]:
    """Two daemons started together (start-up dominates): "patient" waits as long as its
    streams run (600 s: a hang guard) and reads a config file for SIGHUP; "hasty" gives up on
    in-flight requests after 0.2 s."""
    workdir = tmp_path_factory.mktemp("lifecycle")
    checkpoint = build_checkpoint(workdir)
    config = workdir / "daemon.toml"
    config.write_text('[daemon]\nlog_level = "info"\ndrain_timeout_s = 600\n')
    services = {
        "patient": start_daemon(checkpoint, workdir, "patient", "--config", str(config)),
        "hasty": start_daemon(checkpoint, workdir, "hasty", EDGEINFER_DRAIN_TIMEOUT_S="0.2"),
    }
    try:
        yield services
    finally:
        for s in services.values():
            s.stop()


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
    # Serving keeps the pings coming (every 0.2 s with WATCHDOG_USEC=0.4 s), with no stop.
    d.notify.wait_for("WATCHDOG=1", count=len(d.notify.lines("WATCHDOG=1")) + 3)
    assert not d.notify.lines("STOPPING=1")

    config = Path(d.popen.args[d.popen.args.index("--config") + 1])
    config.write_text('[daemon]\nlog_level = "debug"\ndrain_timeout_s = 500\n')
    d.popen.send_signal(signal.SIGHUP)
    d.wait_output("in force now")
    out = d.output()
    assert "SIGHUP: reloaded log_level: 'info' -> 'debug'" in out
    assert "level=debug" in out  # the new level is live
    assert "not reloaded, restart to apply: drain_timeout_s (600.0 -> 500.0)" in out

    stream = open_stream(d.port, max_tokens=LONGEST)
    d.popen.send_signal(signal.SIGTERM)
    d.notify.wait_for("STOPPING=1")
    assert "STATUS=draining: 1 requests in flight" in d.notify.lines("STATUS=draining")
    late = http.client.HTTPConnection("127.0.0.1", d.port, timeout=30)
    late.request("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 2}))
    assert late.getresponse().status == 503  # draining: new work is refused, not queued
    rest = events(stream.read())
    assert rest[-1] == "[DONE]" and not any('"error"' in e for e in rest)
    assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "length"
    assert len(rest) - 1 == LONGEST - 1  # every token after the first, none lost
    assert d.popen.wait(60) == 0, d.output()


def test_daemon_drain_timeout_aborts_with_a_clean_error(daemons: dict[str, Service]) -> None:
    d = daemons["hasty"]
    d.notify.wait_for("READY=1")
    stream = open_stream(d.port, max_tokens=LONGEST)
    d.popen.send_signal(signal.SIGTERM)
    rest = events(stream.read())
    error = json.loads(rest[-2])["error"]
    assert "drain timeout" in error["message"] and error["type"] == "server_error"
    assert rest[-1] == "[DONE]"
    assert 1 + len(rest) - 2 < LONGEST  # cut short by the timeout, not run to its end
    assert d.popen.wait(60) == 0, d.output()
    assert "drain timeout: aborting 1 requests" in d.output()


def test_router_notify_sighup_and_sigterm(tmp_path: Path) -> None:
    port, dead = free_port(), free_port()
    config = tmp_path / "router.toml"
    pop = '[[pop]]\nname = "{}"\nlat = 0\nlon = 0\ndaemons = ["http://127.0.0.1:{}"]\n'
    head = f'[router]\nlisten = "127.0.0.1:{port}"\nhere = "a"\nlog_format = "kv"\n'
    config.write_text(head + pop.format("a", dead))
    cmd = [sys.executable, "-m", "edgeinfer.router.main", "--config", str(config)]
    r = spawn(cmd, tmp_path, "router", port)
    try:
        r.notify.wait_for("READY=1")
        assert http_get(f"http://127.0.0.1:{port}/health")[0] == 503  # listening, no daemons
        config.write_text(
            head.replace("127.0.0.1", "0.0.0.0").replace('"kv"', '"json"')
            + pop.format("a", dead)
            + pop.format("b", free_port())
        )
        r.popen.send_signal(signal.SIGHUP)
        r.wait_output("reloaded 2 PoPs")
        out = r.output()
        assert "not reloaded, restart to apply: listen" in out
        line = next(ln for ln in out.splitlines() if "reloaded 2 PoPs" in ln)
        assert json.loads(line)["level"] == "info"  # the new log format is live
        r.popen.send_signal(signal.SIGINT)  # behaves like SIGTERM: drain, then exit 0
        assert r.popen.wait(60) == 0, r.output()
        assert r.notify.lines("STOPPING=1") and r.notify.lines("WATCHDOG=1")
    finally:
        r.stop()


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
    daemon = [*daemon_cmd(tmp_path / "none", "--kv-port", "0", "--heartbeat-port", "0"), "--port"]
    cases = {
        "daemon port in use": ([*daemon, str(taken)], 1, "cannot listen on"),
        "daemon no model": ([*daemon, "0"], 1, "cannot load model"),
        "router bad key": ([*router, str(bad)], 2, "unknown config key 'hree'"),
        "router port in use": ([*router, str(router_ok)], 1, f"cannot listen on 127.0.0.1:{taken}"),
    }  # fmt: skip
    env = {**os.environ, **DAEMON_ENV}
    procs = {
        name: subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for name, (cmd, _, _) in cases.items()
    }
    try:
        for name, (_, code, needle) in cases.items():
            _, err = procs[name].communicate(timeout=EVENT_TIMEOUT_S)
            last = err.decode().strip().splitlines()[-1]
            assert procs[name].returncode == code, (name, err.decode())
            assert last.startswith("edge-") and ": error: " in last and needle in last, name
    finally:
        busy.close()
        for p in procs.values():
            if p.poll() is None:
                p.kill()
