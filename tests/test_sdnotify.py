"""The NOTIFY_SOCKET protocol against real unix datagram sockets (path and abstract names)."""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from edgeinfer.shared.sdnotify import Notifier


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A datagram socket standing in for systemd, and the NOTIFY_SOCKET value that reaches it."""
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(2.0)
        yield sock, str(path)


def recv_all(sock: socket.socket) -> list[str]:
    """Every datagram already queued."""
    out = []
    sock.setblocking(False)
    try:
        while True:
            out.append(sock.recv(4096).decode())
    except BlockingIOError:
        return out
    finally:
        sock.settimeout(2.0)


def test_path_socket_gets_ready_status_and_stopping(receiver: tuple[socket.socket, str]) -> None:
    sock, address = receiver
    notifier = Notifier.from_env({"NOTIFY_SOCKET": address})
    assert notifier.enabled
    assert notifier.status("loading\nREADY=1")  # a newline must not smuggle in a second key
    assert sock.recv(4096) == b"STATUS=loading READY=1"
    assert notifier.ready("serving")
    assert sock.recv(4096) == b"READY=1\nSTATUS=serving"
    assert notifier.stopping("draining 2")
    assert sock.recv(4096) == b"STOPPING=1\nSTATUS=draining 2"
    notifier.close()


def test_abstract_socket() -> None:
    name = f"edgeinfer-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(2.0)
        notifier = Notifier.from_env({"NOTIFY_SOCKET": "@" + name})
        assert notifier.ready("up")
        assert sock.recv(4096) == b"READY=1\nSTATUS=up"
        notifier.close()


def test_disabled_and_unreachable_are_silent(tmp_path: Path) -> None:
    assert not Notifier.from_env({}).send("READY=1")
    # systemd 254's vsock addresses are not unix sockets: ignored rather than misread.
    assert not Notifier.from_env({"NOTIFY_SOCKET": "vsock:2:1234"}).enabled
    gone = Notifier.from_env({"NOTIFY_SOCKET": str(tmp_path / "nobody.sock")})
    assert gone.enabled and not gone.ready("up")  # no exception: serving goes on


@pytest.mark.parametrize(
    ("env", "interval"),
    [
        ({"WATCHDOG_USEC": "3000000"}, 1.5),
        ({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "SELF"}, 1.5),
        ({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "1"}, None),  # meant for another process
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({}, None),
    ],
)
def test_watchdog_interval_is_half_of_watchdog_usec(
    env: dict[str, str], interval: float | None
) -> None:
    env = {k: str(os.getpid()) if v == "SELF" else v for k, v in env.items()}
    notifier = Notifier.from_env({"NOTIFY_SOCKET": "/run/x", **env})
    assert notifier.watchdog_interval_s == interval


@pytest.mark.asyncio
async def test_watchdog_pings_from_the_loop_and_stops_when_it_is_wedged(
    receiver: tuple[socket.socket, str],
) -> None:
    sock, address = receiver
    notifier = Notifier.from_env({"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "100000"})
    async with notifier.watchdog():
        await pings(sock, 4)  # every 50 ms
        time.sleep(0.4)  # a wedged loop: nothing may be sent meanwhile
        assert recv_all(sock) == []
        await pings(sock, 1)  # the loop turns again, so do the pings

    healthy = False
    async with notifier.watchdog(healthy=lambda: healthy):
        await asyncio.sleep(0.2)
        assert recv_all(sock) == []  # unhealthy: silence, so systemd restarts the service
        healthy = True
        await pings(sock, 1)
    notifier.close()


async def pings(sock: socket.socket, count: int) -> None:
    """Wait for ``count`` more watchdog pings (however long the loop takes to send them)."""
    async with asyncio.timeout(60):  # a hang guard only
        while count > 0:
            count -= recv_all(sock).count("WATCHDOG=1")
            if count > 0:
                await asyncio.sleep(0.005)
