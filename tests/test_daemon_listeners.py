"""The daemon's listening sockets: bound before the model loads, port 0 resolved, ZeroMQ
adopting the bound sockets."""

from __future__ import annotations

import socket

import pytest
import zmq

from edgeinfer.daemon.config import DaemonConfig
from edgeinfer.daemon.listeners import ListenError, Listeners


def any_ports(**overrides: object) -> DaemonConfig:
    fields: dict[str, object] = {"host": "127.0.0.1", "port": 0, "kv_port": 0, "heartbeat_port": 0}
    return DaemonConfig(**(fields | overrides))  # type: ignore[arg-type]


def test_port_0_resolves_to_the_ports_bound() -> None:
    listeners = Listeners.bind(any_ports())
    try:
        config = listeners.resolve(any_ports())
        ports = {config.port, config.kv_port, config.heartbeat_port}
        assert 0 not in ports and len(ports) == 3
        assert config.kv_endpoint == f"tcp://127.0.0.1:{config.kv_port}"
        with socket.create_connection(("127.0.0.1", config.port)):
            pass  # listening already, before anything serves
    finally:
        listeners.close()


def test_a_decode_daemon_binds_no_kv_port() -> None:
    listeners = Listeners.bind(any_ports(role="decode"))
    try:
        assert listeners.kv is None and listeners.take_kv() is None
        assert listeners.resolve(any_ports(role="decode")).kv_port == 0
    finally:
        listeners.close()


def test_a_port_in_use_names_its_key_and_releases_the_others() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        http = socket.socket()
        http.bind(("127.0.0.1", 0))
        port = http.getsockname()[1]
        http.close()
        with pytest.raises(ListenError) as failure:
            Listeners.bind(any_ports(port=port, heartbeat_port=taken))
    assert str(failure.value) == (
        f"cannot listen on 127.0.0.1:{taken} (heartbeat_port): Address already in use"
    )
    socket.create_server(("127.0.0.1", port)).close()  # the HTTP socket bound first was closed


def test_zeromq_adopts_a_bound_socket() -> None:
    listeners = Listeners.bind(any_ports())
    config = listeners.resolve(any_ports())
    ctx = zmq.Context()
    pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
    try:
        pub.setsockopt(zmq.USE_FD, listeners.take_heartbeat())
        pub.bind(config.zmq_bind(config.heartbeat_port))
        assert pub.getsockopt_string(zmq.LAST_ENDPOINT) == config.heartbeat_endpoint
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(config.heartbeat_endpoint)
        while not sub.poll(10):  # a subscription takes a moment to reach the publisher
            pub.send(b"beat")
        assert sub.recv() == b"beat"
    finally:
        pub.close(linger=0)
        sub.close(linger=0)
        ctx.term()
        listeners.close()
