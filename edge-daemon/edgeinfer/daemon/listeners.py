"""The daemon's listening sockets, all bound at start-up, before the model loads.

Binding first has two uses. A port in use ends the start-up at once instead of after a load
that can take minutes. Port 0 ("any free port", for several daemons on one host) resolves
before anything reports an address: :meth:`Listeners.resolve` puts the ports the kernel chose
into the config, and ``/v1/state``, heartbeats and logs all read them from there.

The HTTP socket goes to aiohttp. The KV and heartbeat sockets are handed to their ZeroMQ
sockets once the model has loaded, through ``ZMQ_USE_FD`` (libzmq's option for systemd socket
activation); a ZeroMQ socket that takes one owns it from then on and closes it.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from dataclasses import dataclass

from edgeinfer.daemon.config import DaemonConfig
from edgeinfer.shared.errors import EdgeInferError

_EVERY_INTERFACE = ("", "0.0.0.0")


class ListenError(EdgeInferError):
    """A port of the daemon cannot be bound (in use, not permitted, bad address)."""


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: any free one) and listening.

    ``0.0.0.0`` (or an empty host) is every IPv4 interface and ``::`` every interface of both
    families; a name binds its first IPv4 address (as ZeroMQ resolves it, so peers given the
    name reach the socket), or its first address when it has no IPv4 one.
    """
    if host in _EVERY_INTERFACE:
        return socket.create_server(("0.0.0.0", port))
    if host == "::":
        dual = socket.has_dualstack_ipv6()
        return socket.create_server(("::", port), family=socket.AF_INET6, dualstack_ipv6=dual)
    try:
        found = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family, _, _, _, address = found[0]
    return socket.create_server(address[:2], family=family)


@dataclass
class Listeners:
    http: socket.socket
    kv: socket.socket | None  # None on a decode daemon: it serves no prefills
    heartbeat: socket.socket

    @classmethod
    def bind(cls, config: DaemonConfig) -> Listeners:
        """Bind every port ``config`` names; raises :class:`ListenError` naming the port."""
        wanted = {"port": config.port, "heartbeat_port": config.heartbeat_port}
        if config.role != "decode":
            wanted["kv_port"] = config.kv_port
        bound: dict[str, socket.socket] = {}
        try:
            for key, port in wanted.items():
                try:
                    bound[key] = listen(config.host, port)
                except OSError as exc:
                    # Not exc.strerror for a socket error: create_server appends the address.
                    errno = exc.errno or 0
                    reason = os.strerror(errno) if errno > 0 else exc.strerror or str(exc)
                    raise ListenError(
                        f"cannot listen on {config.host}:{port} ({key}): {reason}"
                    ) from exc
        except ListenError:
            for sock in bound.values():
                sock.close()
            raise
        return cls(bound["port"], bound.get("kv_port"), bound["heartbeat_port"])

    def resolve(self, config: DaemonConfig) -> DaemonConfig:
        """``config`` with the ports actually bound (they differ from it only where it said 0)."""
        kv_port = _port(self.kv) if self.kv is not None else config.kv_port
        return dataclasses.replace(
            config, port=_port(self.http), kv_port=kv_port, heartbeat_port=_port(self.heartbeat)
        )

    def take_kv(self) -> int | None:
        """The KV socket's descriptor, for a ZeroMQ socket to bind with (which then owns it)."""
        return self.kv.detach() if self.kv is not None else None

    def take_heartbeat(self) -> int:
        """The heartbeat socket's descriptor (see :meth:`take_kv`)."""
        return self.heartbeat.detach()

    def close(self) -> None:
        """Close what was not handed over (after a load that failed or was stopped)."""
        for sock in (self.http, self.kv, self.heartbeat):
            if sock is not None:
                sock.close()


def _port(sock: socket.socket) -> int:
    return int(sock.getsockname()[1])
