"""SIGTERM at each point of a daemon's start-up ends it promptly with status 0 (a stop or
restart during start-up is routine under systemd): during the imports, when ``/health`` first
answers 503, and while the load is held blocked or inside torch's kernels, where an interpreter
exit used to kill the process with SIGABRT or SIGSEGV."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster import free_port, http_get
from daemon_helpers import build_checkpoint
from edgeinfer.daemon.engine.default_model import SMOLLM2_DIR
from edgeinfer.shared.cache_dir import cache_dir
from service_helpers import (
    EVENT_TIMEOUT_S,
    Service,
    catches,
    daemon_cmd,
    spawn,
    wait_until,
)

pytestmark = pytest.mark.slow
SMALL = {"EDGEINFER_NUM_KV_BLOCKS": "64", "EDGEINFER_MAX_MODEL_LEN": "512"}
HELD_LOAD = Path(__file__).with_name("held_load_daemon.py")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("stop_while_loading"))


@pytest.fixture
def started(tmp_path: Path) -> Iterator[list[Service]]:
    """Daemons a test started; killed if the test left one running."""
    services: list[Service] = []
    yield services
    for s in services:
        s.stop()


def start(
    services: list[Service],
    workdir: Path,
    model: str | Path | None,
    env: dict[str, str] | None = None,
    launcher: Path | None = None,
) -> Service:
    port = free_port()
    ports = ["--port", str(port), "--kv-port", "0", "--heartbeat-port", "0"]
    cmd = daemon_cmd(model, *ports, launcher=launcher)
    service = spawn(cmd, workdir, "daemon", port, {**SMALL, **(env or {})})
    services.append(service)
    return service


def first_503(service: Service) -> None:
    def answers_503() -> bool:
        if service.popen.poll() is not None:
            raise AssertionError(f"exited {service.popen.returncode}:\n{service.output()}")
        try:
            return http_get(f"http://127.0.0.1:{service.port}/health", timeout=5)[0] == 503
        except OSError:
            return False  # not listening yet

    wait_until(answers_503, "/health answering 503")


def assert_stops_cleanly(service: Service) -> str:
    """SIGTERM now; the process must exit 0 without a crash report. Returns its output."""
    service.popen.send_signal(signal.SIGTERM)
    code = service.popen.wait(EVENT_TIMEOUT_S)
    out = service.output()
    assert code == 0, out
    for crash in ("Traceback", "terminate called", "Fatal Python error", "Segmentation fault"):
        assert crash not in out, out
    return out


def test_sigterm_during_the_imports(
    checkpoint: Path, tmp_path: Path, started: list[Service]
) -> None:
    service = start(started, tmp_path, checkpoint)
    # The earliest point the daemon can act on: its handler exists, the imports run on.
    wait_until(lambda: catches(service.popen.pid, signal.SIGTERM), "a SIGTERM handler")
    out = assert_stops_cleanly(service)
    assert "listening on" not in out


def test_sigterm_when_health_first_answers_503(
    checkpoint: Path, tmp_path: Path, started: list[Service]
) -> None:
    service = start(started, tmp_path, checkpoint)
    first_503(service)
    assert_stops_cleanly(service)
    assert service.notify.lines("STOPPING=1")


@pytest.mark.parametrize("hold", ["blocked", "torch"])
def test_sigterm_while_the_load_is_held(
    checkpoint: Path, tmp_path: Path, started: list[Service], hold: str
) -> None:
    """The load never ends here, so an exit at all shows that the stop did not wait for it."""
    marker = tmp_path / "held"
    env = {"EDGEINFER_TEST_HOLD": hold, "EDGEINFER_TEST_HOLD_MARKER": str(marker)}
    service = start(started, tmp_path, checkpoint, env, launcher=HELD_LOAD)
    wait_until(marker.exists, f"the load held ({hold})")
    assert http_get(f"http://127.0.0.1:{service.port}/health")[0] == 503
    out = assert_stops_cleanly(service)
    assert "had not finished loading" in out
    assert service.notify.lines("STOPPING=1") and not service.notify.lines("READY=1")


def test_sigterm_while_the_built_in_model_loads(tmp_path: Path, started: list[Service]) -> None:
    """The built-in model as the issue saw it, when it is already converted on this host."""
    if not (cache_dir() / "models" / SMOLLM2_DIR / "config.json").is_file():
        pytest.skip("the built-in model is not converted on this host (needs a download)")
    service = start(started, tmp_path, None)
    first_503(service)
    assert_stops_cleanly(service)
