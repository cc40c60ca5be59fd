"""The real ``edge-daemon`` process with the official OpenAI client, and its start-up errors."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import zmq
from click.testing import CliRunner
from openai.types.chat import ChatCompletionMessageParam

from daemon_helpers import build_checkpoint, free_port
from edgeinfer.daemon.config import load_daemon_config
from edgeinfer.daemon.main import EXIT_CONFIG, EXIT_RUNTIME, main
from edgeinfer.shared.errors import ConfigError
from edgeinfer.shared.heartbeat import Heartbeat
from service_helpers import EVENT_TIMEOUT_S, daemon_cmd, spawn

# Keeps the KV allocation (and so start-up) small; the real default is a byte budget.
SMALL_ENV = {"EDGEINFER_NUM_KV_BLOCKS": "64", "EDGEINFER_MAX_MODEL_LEN": "512"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("daemon_process"))


def wait_healthy(port: int, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"edge-daemon exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass  # not listening yet, or 503 while the model loads
        time.sleep(0.1)
    raise AssertionError("edge-daemon did not become healthy")


@pytest.mark.slow
def test_daemon_process_with_openai_client(checkpoint: Path, tmp_path: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "edgeinfer.daemon.main", "--model", str(checkpoint)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--kv-port", "0", "--heartbeat-port", "0"]
    log = (tmp_path / "daemon.log").open("wb")
    proc = subprocess.Popen(cmd, env={**os.environ, **SMALL_ENV}, stdout=log, stderr=log)
    try:
        wait_healthy(port, proc)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        model = str(checkpoint)  # served under its --model spec, as vLLM does
        assert [m.id for m in client.models.list()] == [model]

        done = client.completions.create(model=model, prompt="Hello", max_tokens=5, temperature=0)
        assert done.choices[0].finish_reason in ("stop", "length")
        assert done.usage is not None and done.usage.completion_tokens >= 1
        streamed = client.completions.create(
            model=model, prompt="Hello", max_tokens=5, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in streamed) == done.choices[0].text

        messages: list[ChatCompletionMessageParam] = [
            {"role": "user", "content": "What is the capital of France?"}
        ]
        chat = client.chat.completions.create(
            model=model, messages=messages, max_tokens=6, temperature=0
        )
        assert chat.choices[0].message.role == "assistant"
        assert chat.usage is not None
        chunks = list(
            client.chat.completions.create(
                model=model,
                messages=messages,
                max_tokens=6,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == chat.choices[0].message.content
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens == chat.usage.completion_tokens

        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt="hi")
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=model, prompt="hi", best_of=2)
        assert info.value.param == "best_of"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    assert proc.returncode == 0, (tmp_path / "daemon.log").read_text()


@pytest.mark.slow
def test_two_daemons_on_one_host_with_every_port_0(checkpoint: Path, tmp_path: Path) -> None:
    """Port 0 everywhere: each daemon binds free ports and reports the ones it got (log line,
    /v1/state, heartbeats), so a second daemon on the host needs no port planning."""
    ports = ["--port", "0", "--kv-port", "0", "--heartbeat-port", "0"]
    env = {**SMALL_ENV, "EDGEINFER_HEARTBEAT_INTERVAL_S": "0.2"}
    services = [
        spawn(daemon_cmd(checkpoint, *ports, "--pop", name), tmp_path, name, 0, env)
        for name in ("first", "second")
    ]
    try:
        bound = []
        for s in services:
            s.port = int(s.wait_output(r"listening on http://127\.0\.0\.1:(\d+)")[1])
            wait_healthy(s.port, s.popen, timeout=EVENT_TIMEOUT_S)
            with urllib.request.urlopen(f"http://127.0.0.1:{s.port}/v1/state") as r:
                state = json.load(r)
            kv, hb = state["kv_endpoint"], state["heartbeat_endpoint"]
            assert f"KV transfer on {kv}, heartbeats on {hb}" in s.output()
            bound += [s.port, int(kv.rsplit(":", 1)[1]), int(hb.rsplit(":", 1)[1])]
            beat = first_heartbeat(hb)
            assert (beat.daemon_id, beat.kv_endpoint) == (f"http://127.0.0.1:{s.port}", kv)
        assert 0 not in bound and len(set(bound)) == 6
    finally:
        for s in services:
            s.popen.send_signal(signal.SIGTERM)
        codes = [s.popen.wait(EVENT_TIMEOUT_S) for s in services]
    assert codes == [0, 0], [s.output() for s in services]


def first_heartbeat(endpoint: str) -> Heartbeat:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        # The first heartbeat went out before this subscribed: this is a later one.
        assert sub.poll(EVENT_TIMEOUT_S * 1000), f"no heartbeat from {endpoint}"
        return Heartbeat.decode(sub.recv())
    finally:
        sub.close(linger=0)
        ctx.term()


def invoke(args: list[str]) -> tuple[int, str]:
    result = CliRunner().invoke(main, args, env=SMALL_ENV)
    return result.exit_code, result.output


def test_bad_config_is_one_line_and_exit_2(tmp_path: Path) -> None:
    code, out = invoke(["--port", "70000"])
    assert code == EXIT_CONFIG
    assert out.strip().count("\n") == 0 and out.startswith("edge-daemon: error: ")
    assert "port" in out

    config = tmp_path / "edge.toml"
    config.write_text('[daemon]\nrole = "prefill"\nprefil-peers = ["tcp://a:1"]\n')
    code, out = invoke(["--config", str(config)])
    assert code == EXIT_CONFIG and "did you mean 'prefill_peers'" in out

    code, out = invoke(["--role", "observer"])
    assert code == EXIT_CONFIG and "role" in out


def test_unreadable_model_exits_1(tmp_path: Path) -> None:
    port = free_port()
    code, out = invoke(["--model", str(tmp_path / "missing"), "--port", str(port)])
    assert code == EXIT_RUNTIME
    assert out.startswith("edge-daemon: error: cannot load model") and out.count("\n") == 1


def test_port_in_use_exits_1(checkpoint: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, out = invoke(["--model", str(checkpoint), "--host", "127.0.0.1", "--port", str(port)])
    assert code == EXIT_RUNTIME
    assert out.startswith(f"edge-daemon: error: cannot listen on 127.0.0.1:{port}")


def test_zmq_port_in_use_exits_1_before_loading(tmp_path: Path) -> None:
    """Every port is bound before the model loads: a taken heartbeat port is reported at once
    (the missing model would fail later, were the load ever reached)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = ["--model", str(tmp_path / "missing"), "--host", "127.0.0.1", "--port", "0"]
        code, out = invoke([*args, "--heartbeat-port", str(port)])
    assert code == EXIT_RUNTIME
    expected = f"cannot listen on 127.0.0.1:{port} (heartbeat_port): Address already in use"
    assert out == f"edge-daemon: error: {expected}\n"


def test_config_layers_and_engine_config(tmp_path: Path) -> None:
    toml = tmp_path / "edge.toml"
    toml.write_text(
        '[daemon]\nmodel = "tiny"\nport = 9000\nblock-size = 32\nprefill-peers = ["tcp://p:5600"]\n'
    )
    env = {"EDGEINFER_PORT": "9100", "EDGEINFER_POP": "fra1"}
    config = load_daemon_config(toml, env=env, overrides={"port": 9200, "role": None})
    assert (config.port, config.pop, config.role) == (9200, "fra1", "both")
    assert config.prefill_peers == ("tcp://p:5600",) and config.model_name == "tiny"
    engine = config.to_engine_config()
    assert engine.model == "tiny" and engine.block_size == 32 and engine.show_progress is False


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"block_size": 3}, "block_size"),
        ({"port": 5600}, "kv_port"),
        ({"prefill_peers": ("p:5600",)}, "prefill_peers"),
        ({"curve_server_public_key": "/k/prefill.key"}, "curve_secret_key"),
        ({"local_prefill_threshold": -1}, "local_prefill_threshold"),
    ],
)
def test_invalid_config(overrides: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        load_daemon_config(env={}, overrides=overrides)
