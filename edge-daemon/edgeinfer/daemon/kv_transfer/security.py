"""CURVE encryption and client allow-listing for KV-transfer sockets.

Prefill and decode daemons in different PoPs exchange KV (i.e. the user's prompt, in a
recoverable form) across networks we do not own, so the link is encrypted with ZeroMQ CURVE and
the server side accepts only clients whose public key file sits in an allow-list directory.

Key files are the ZeroMQ certificate format (``zmq.auth``): ``NAME.key`` holds the public key and
is what peers get; ``NAME.key_secret`` holds both keys and never leaves its host.

Typical use, with every option set *before* ``bind``/``connect`` (libzmq reads them then)::

    auth = start_authenticator(ctx, Path("/etc/edgeinfer/clients"))   # once per context
    configure_server(router, Path("/etc/edgeinfer/prefill.key_secret"))
    router.bind("tcp://0.0.0.0:5600")
    ...
    configure_client(dealer, Path("decode.key_secret"), Path("prefill.key"))
    dealer.connect("tcp://prefill:5600")
    ...
    auth.stop()

A refused client gets no error on its socket: its messages simply never arrive, so the daemon
must rely on its request timeouts (and the authenticator's log) to notice a key mismatch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from edgeinfer.daemon.kv_transfer.errors import SecurityError

_Z85_KEY_LEN = 40  # a 32-byte CURVE key in Z85 text form


def generate_keys(directory: Path, name: str) -> tuple[Path, Path]:
    """Create ``directory/name.key`` and ``directory/name.key_secret``; return (public, secret).

    Refuses to overwrite an existing pair: peers that trust the old public key would be locked
    out with no error message (see the module docstring).
    """
    public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
    if public.exists() or secret.exists():
        raise SecurityError(f"CURVE key {name!r} already exists in {directory}")
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    zmq.auth.create_certificates(directory, name)
    secret.chmod(0o600)
    return public, secret


def load_keypair(secret_file: Path) -> tuple[bytes, bytes]:
    """(public, secret) key from a ``.key_secret`` file."""
    public, secret = _load(secret_file)
    if secret is None:
        raise SecurityError(f"{secret_file} holds no secret key; pass the .key_secret file")
    return public, secret


def load_public_key(public_file: Path) -> bytes:
    """The public key from a ``.key`` (or ``.key_secret``) file."""
    return _load(public_file)[0]


def configure_server(sock: zmq.Socket[Any], secret_file: Path) -> None:
    """Make ``sock`` a CURVE server with the key pair in ``secret_file``."""
    public, secret = load_keypair(secret_file)
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_server = True


def configure_client(sock: zmq.Socket[Any], secret_file: Path, server_public_file: Path) -> None:
    """Make ``sock`` a CURVE client with its own key pair, trusting only the given server key."""
    public, secret = load_keypair(secret_file)
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_serverkey = load_public_key(server_public_file)


def start_authenticator(
    context: zmq.Context[Any], allowed_clients_dir: Path
) -> ThreadAuthenticator:
    """Start a ZAP handler on ``context`` that admits only the public keys in the directory.

    A thread rather than an asyncio authenticator so it works whatever event loop (or none) the
    daemon runs its sockets on. Keys added later need another ``configure_curve`` call. The
    caller owns the returned authenticator and must ``stop()`` it before closing the context.
    """
    if not allowed_clients_dir.is_dir() or not any(allowed_clients_dir.glob("*.key")):
        # An empty allow-list would refuse every client silently; fail at start-up instead.
        raise SecurityError(f"no client public keys (*.key) in {allowed_clients_dir}")
    for key_file in allowed_clients_dir.glob("*.key"):
        _load(key_file)  # reject a corrupt file now, not as a mysterious refusal later
    auth = ThreadAuthenticator(context)
    auth.start()
    auth.configure_curve(domain="*", location=os.fspath(allowed_clients_dir))
    return auth


def _load(path: Path) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise SecurityError(f"cannot load CURVE key from {path}: {e}") from e
    if len(public) != _Z85_KEY_LEN or (secret is not None and len(secret) != _Z85_KEY_LEN):
        raise SecurityError(f"{path} holds a malformed CURVE key")
    return public, secret
