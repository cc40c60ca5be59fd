"""systemd's ``sd_notify`` protocol, spoken directly: one datagram to ``$NOTIFY_SOCKET``.

A message is newline-separated ``KEY=VALUE`` assignments (``READY=1``, ``STATUS=...``,
``STOPPING=1``, ``WATCHDOG=1``) sent as one datagram to the unix socket systemd names in
``NOTIFY_SOCKET``; a leading ``@`` names a socket in the abstract namespace. Outside systemd
(no variable) every call is a cheap no-op, so the processes need no "under systemd?" branches.

The watchdog is pinged from an asyncio task, on purpose: a ping proves the event loop still
turns, so a wedged loop stops the pings and systemd restarts the service (``WatchdogSec=``).
A failed send is logged once at debug level and otherwise ignored: a lost notification must
never take a serving process down. READY=1 and STOPPING=1 wait up to a second for room in a full
socket queue (systemd must see them); STATUS= and WATCHDOG=1 are dropped instead, so a slow
systemd never stalls the event loop for a progress line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable, Mapping

from edgeinfer.shared.tasks import cancel_and_wait

log = logging.getLogger(__name__)

_MUST_ARRIVE_S = 1.0  # how long READY=1 / STOPPING=1 may wait for room in systemd's queue


class Notifier:
    """Sends notifications to one ``NOTIFY_SOCKET`` address; ``None`` disables it."""

    def __init__(self, address: str | None, watchdog_usec: int | None = None) -> None:
        self.address = address
        # systemd asks for a ping at least every WATCHDOG_USEC; half of it leaves room for a
        # slow loop iteration, as sd_watchdog_enabled(3) recommends.
        self.watchdog_interval_s = watchdog_usec / 2e6 if watchdog_usec else None
        self._sock: socket.socket | None = None
        self._warned = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, pid: int | None = None) -> Notifier:
        """Read ``NOTIFY_SOCKET``, ``WATCHDOG_USEC`` and ``WATCHDOG_PID`` from ``env``."""
        env = os.environ if env is None else env
        address = env.get("NOTIFY_SOCKET") or None
        if address is not None and not address.startswith(("/", "@")):
            # e.g. systemd 254's vsock: addresses, meant for a VM's host; not ours to reach.
            log.debug("NOTIFY_SOCKET=%s is not a unix socket path: not notifying", address)
            address = None
        usec: int | None = None
        raw = env.get("WATCHDOG_USEC", "")
        watchdog_pid = env.get("WATCHDOG_PID", "")
        # WATCHDOG_PID names the process systemd watches; another one (a child that inherited
        # the environment) must not ping on its behalf.
        mine = not watchdog_pid or watchdog_pid == str(os.getpid() if pid is None else pid)
        if raw.isdigit() and int(raw) > 0 and mine:
            usec = int(raw)
        return cls(address, usec)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *assignments: str, wait_s: float = 0.0) -> bool:
        """Send ``KEY=VALUE`` lines as one datagram; False when disabled or it was not sent.

        ``wait_s``: how long a full socket queue may hold the caller (0: drop the message).
        """
        if self.address is None:
            return False
        message = "\n".join(assignments).encode()
        try:
            if self._sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
                sock.connect(target)
                self._sock = sock
            self._sock.settimeout(wait_s)
            self._sock.send(message)
        except OSError as exc:
            if not self._warned:
                log.debug("cannot notify systemd at %s: %s", self.address, exc)
                self._warned = True
            self.close()
            return False
        return True

    def ready(self, status: str) -> bool:
        return self.send("READY=1", _status(status), wait_s=_MUST_ARRIVE_S)

    def status(self, text: str) -> bool:
        return self.send(_status(text))

    def stopping(self, status: str) -> bool:
        return self.send("STOPPING=1", _status(status), wait_s=_MUST_ARRIVE_S)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    @contextlib.asynccontextmanager
    async def watchdog(self, healthy: Callable[[], bool] | None = None) -> AsyncIterator[None]:
        """Ping ``WATCHDOG=1`` from this event loop while the block runs.

        ``healthy`` (optional) gates each ping: a process that can still turn its loop but can
        no longer do its job (its engine thread died) stops pinging and gets restarted too.
        """
        interval = self.watchdog_interval_s
        if not self.enabled or interval is None:
            yield
            return

        async def ping() -> None:
            while True:
                if healthy is None or healthy():
                    self.send("WATCHDOG=1")
                await asyncio.sleep(interval)

        task = asyncio.create_task(ping(), name="sd-watchdog")
        try:
            yield
        finally:
            await cancel_and_wait(task)


def _status(text: str) -> str:
    # A newline would end the assignment early and smuggle in another key.
    return "STATUS=" + " ".join(text.split())
