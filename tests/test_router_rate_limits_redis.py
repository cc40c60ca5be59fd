"""Two routers' Gates sharing tenant limits through a real ``redis-server`` (started here).

The server runs on a free port without persistence and is killed by pid. Killing it mid-test
checks the outage rule: limits fall back to each router's memory (logged, counted), and come
back to Redis once it answers again.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from aiohttp.test_utils import make_mocked_request

from edgeinfer.router import rate_limits
from edgeinfer.router.config import RouterConfig
from edgeinfer.router.gate import Admission, Gate, GateRejection
from edgeinfer.router.tenants import TenantKey, key_digest, keys_file_toml
from edgeinfer.shared.processes import free_port

REDIS = shutil.which("redis-server")
pytestmark = pytest.mark.skipif(REDIS is None, reason="redis-server is not installed")
KEY = "ei-shared-tenant-key"


class RedisServer:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        assert REDIS is not None
        self.proc = subprocess.Popen(
            [REDIS, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while not self._pong():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start (exit {self.proc.poll()})")
            time.sleep(0.05)

    def _pong(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest_asyncio.fixture
async def routers(tmp_path: Path, redis: RedisServer) -> AsyncIterator[tuple[Gate, Gate]]:
    """Two Gates as two routers of one region would build them: same file, same Redis."""
    path = tmp_path / "keys.toml"
    entry = TenantKey(tenant="acme", sha256=key_digest(KEY), requests_per_minute=3,
                      tokens_per_minute=1000)  # fmt: skip
    path.write_text(keys_file_toml([entry], ""))
    config = RouterConfig(api_keys_file=path, rate_limit_storage=f"redis://127.0.0.1:{redis.port}")
    gates = (await Gate.create(config), await Gate.create(config))
    try:
        yield gates
    finally:
        for gate in gates:
            await gate.close()


async def admit(gate: Gate, tokens: int = 0) -> Admission:
    request = make_mocked_request(
        "POST", "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}
    )
    return await gate.admit(request, "tiny", tokens)


async def refused(gate: Gate) -> GateRejection:
    with pytest.raises(GateRejection) as err:
        await admit(gate)
    return err.value


@pytest.mark.asyncio
async def test_two_routers_share_one_tenants_windows(routers: tuple[Gate, Gate]) -> None:
    a, b = routers
    first = await admit(a, tokens=100)
    assert first.response_headers()["x-ratelimit-remaining-requests"] == "2"
    # The second router sees the first's request and tokens.
    second = await admit(b, tokens=200)
    assert second.response_headers()["x-ratelimit-remaining-requests"] == "1"
    assert second.response_headers()["x-ratelimit-remaining-tokens"] == "700"
    await admit(a)
    rejection = await refused(b)
    assert (rejection.status, rejection.code) == (429, "rate_limit_exceeded")
    assert int(rejection.headers["Retry-After"]) >= 1
    assert (await refused(a)).status == 429
    for adm in (first, second):
        await adm.finish()
    assert not a.degraded and a.storage_errors == 0


@pytest.mark.asyncio
async def test_a_redis_outage_falls_back_to_each_routers_memory(
    routers: tuple[Gate, Gate],
    redis: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(rate_limits, "RETRY_REDIS_AFTER_S", 0.0)  # try Redis on every call
    a, b = routers
    await admit(a)
    await admit(b)
    redis.kill()
    # Redis is gone: a's window restarts in a's memory (3 more), the endpoint keeps answering.
    for _ in range(3):
        await admit(a)
    assert (await refused(a)).status == 429
    assert a.degraded and a.storage_errors >= 4
    assert "limits are enforced by this router alone" in caplog.text
    # Back: the windows live in Redis again (it restarted empty).
    redis.start()
    with contextlib.suppress(GateRejection):
        await admit(a)  # the first call after the outage reconnects
    assert not a.degraded
    assert "answers again: limits shared" in caplog.text
    admission = await admit(b)
    assert int(admission.response_headers()["x-ratelimit-remaining-requests"]) <= 1
