"""CURVE security for KV-transfer sockets: encrypted loopback works, unknown clients are refused."""

from __future__ import annotations

import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from edgeinfer.daemon.kv_transfer.errors import SecurityError
from edgeinfer.daemon.kv_transfer.security import (
    configure_client,
    configure_server,
    generate_keys,
    load_keypair,
    load_public_key,
    start_authenticator,
)


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, tuple[Path, Path]]:
    """Server, allowed client and stranger key pairs; only the client's public key is allowed."""
    pairs = {
        "server": generate_keys(tmp_path / "server", "prefill"),
        "client": generate_keys(tmp_path / "client", "decode"),
        "stranger": generate_keys(tmp_path / "stranger", "decode"),
    }
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "decode.key").write_bytes(pairs["client"][0].read_bytes())
    return pairs


@pytest.fixture
def server(
    tmp_path: Path, keys: dict[str, tuple[Path, Path]]
) -> Iterator[tuple[zmq.Socket[bytes], str]]:
    ctx = zmq.Context()
    auth = start_authenticator(ctx, tmp_path / "allowed")
    router = ctx.socket(zmq.ROUTER)
    configure_server(router, keys["server"][1])
    port = router.bind_to_random_port("tcp://127.0.0.1")
    yield router, f"tcp://127.0.0.1:{port}"
    router.close(linger=0)
    auth.stop()
    ctx.term()


def client(
    ctx: zmq.Context[zmq.Socket[bytes]], secret: Path, server_public: Path, endpoint: str
) -> zmq.Socket[bytes]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    configure_client(dealer, secret, server_public)
    dealer.connect(endpoint)
    return dealer


def test_allowed_client_talks(
    server: tuple[zmq.Socket[bytes], str], keys: dict[str, tuple[Path, Path]]
) -> None:
    router, endpoint = server
    ctx = zmq.Context()
    dealer = client(ctx, keys["client"][1], keys["server"][0], endpoint)
    dealer.send_multipart([b"hello", b"kv"])
    assert router.poll(5000), "encrypted message never arrived"
    identity, *body = router.recv_multipart()
    assert body == [b"hello", b"kv"]
    router.send_multipart([identity, b"pong"])
    assert dealer.poll(5000) and dealer.recv() == b"pong"
    dealer.close()
    ctx.term()


def test_unknown_client_is_refused(
    server: tuple[zmq.Socket[bytes], str], keys: dict[str, tuple[Path, Path]]
) -> None:
    router, endpoint = server
    ctx = zmq.Context()
    dealer = client(ctx, keys["stranger"][1], keys["server"][0], endpoint)
    dealer.send(b"let me in")
    assert not router.poll(1000), "a client with an unknown key got through"
    dealer.close()
    ctx.term()


def test_key_files(tmp_path: Path) -> None:
    public, secret = generate_keys(tmp_path / "k", "node")
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert load_keypair(secret)[0] == load_public_key(public)
    with pytest.raises(SecurityError, match="already exists"):
        generate_keys(tmp_path / "k", "node")
    with pytest.raises(SecurityError, match="no secret key"):
        load_keypair(public)
    with pytest.raises(SecurityError, match="cannot load"):
        load_public_key(tmp_path / "missing.key")
    (tmp_path / "bad.key").write_text('public-key = "short"\n')
    with pytest.raises(SecurityError, match="malformed"):
        load_public_key(tmp_path / "bad.key")


def test_authenticator_refuses_empty_allow_list(tmp_path: Path) -> None:
    ctx = zmq.Context()
    with pytest.raises(SecurityError, match="no client public keys"):
        start_authenticator(ctx, tmp_path)
    ctx.term()
