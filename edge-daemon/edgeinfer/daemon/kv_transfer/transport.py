"""ZeroMQ plumbing shared by both transfer sides, and the decode side's per-peer connection.

:class:`PeerConnection` is one DEALER socket to one prefill endpoint, shared by every request
sent there: a receive task validates each message and routes it by ``rid`` to that request's
inbox, and a monitor task turns a lost or refused connection into an immediate
:class:`PrefillFailed` for the requests waiting on it, so they need not sit out their timeout.
It also pings the endpoint whenever it (re)connects: the pong says which protocol extensions the
prefill daemon there supports (:attr:`PeerConnection.features`), as :mod:`.wire` describes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from edgeinfer.daemon.kv_transfer.dedup import DuplicateFilter
from edgeinfer.daemon.kv_transfer.errors import KVTransferError, WireError
from edgeinfer.daemon.kv_transfer.messages import KVChunk, Message, Ping, Pong
from edgeinfer.daemon.kv_transfer.security import configure_client
from edgeinfer.daemon.kv_transfer.stats import TransferStats
from edgeinfer.daemon.kv_transfer.wire import WireLimits, decode, encode, limit_socket

log = logging.getLogger(__name__)

# ZMTP heartbeats notice a peer whose host vanished without closing TCP (power loss, partition)
# within a few seconds instead of the kernel's keepalive hours.
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000
# Queued messages per peer (each frame counts). KV messages are MBs, so this bounds memory and
# makes a slow reader push back on the sender instead of growing its queue without limit.
HIGH_WATER_MARK = 256
# Back off reconnects to a dead peer from libzmq's 100 ms up to this.
RECONNECT_IVL_MAX_MS = 5000

# From this many bytes on, the CRC-32 work of encode/decode (ISA-L: ~15 GB/s) runs in a worker
# thread: isal releases the GIL, so it overlaps ZeroMQ I/O and the event loop keeps serving
# other requests instead of stalling ~1 ms per 4 MiB chunk.
OFFLOAD_BYTES = 1 << 18

_FAIL_EVENTS: dict[int, str] = {
    zmq.EVENT_DISCONNECTED: "peer_disconnected",
    zmq.EVENT_CONNECT_RETRIED: "peer_unreachable",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake_failed",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake_failed",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "handshake_failed",
}


class PrefillFailed(KVTransferError):
    """A remote prefill did not complete; its reserved blocks are already freed.

    ``reason`` is a short stable code (a metric label); ``code`` is the prefill server's error
    code when it sent an error reply.
    """

    def __init__(self, reason: str, detail: str = "", *, code: str | None = None) -> None:
        super().__init__(f"remote prefill failed: {reason}" + (f" ({detail})" if detail else ""))
        self.reason = reason
        self.code = code


@dataclass(frozen=True)
class ClientCurve:
    """CURVE settings of a decode daemon: its own key pair and the prefill servers' keys."""

    secret_file: Path
    server_public_file: Path
    per_endpoint: Mapping[str, Path] = field(default_factory=dict)  # endpoint -> server key

    def server_key(self, endpoint: str) -> Path:
        return self.per_endpoint.get(endpoint, self.server_public_file)


@dataclass(frozen=True)
class ServerCurve:
    """CURVE settings of a prefill daemon: its key pair and the allowed decode clients' keys."""

    secret_file: Path
    allowed_clients_dir: Path


def tune_socket(sock: zmq.Socket[Any], limits: WireLimits) -> None:
    """Options every transfer socket needs, set before bind/connect (libzmq reads them then)."""
    sock.linger = 0  # a closed transfer is abandoned anyway; never block shutdown on it
    sock.sndhwm = sock.rcvhwm = HIGH_WATER_MARK
    sock.reconnect_ivl_max = RECONNECT_IVL_MAX_MS
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    limit_socket(sock, limits)


def frames_nbytes(frames: Sequence[Any]) -> int:
    return sum(memoryview(f).nbytes for f in frames)


async def encode_off_loop(msg: Message) -> list[bytes | memoryview]:
    if isinstance(msg, KVChunk) and sum(p.nbytes for p in msg.frames) >= OFFLOAD_BYTES:
        return await asyncio.to_thread(encode, msg)
    return encode(msg)


async def decode_off_loop(frames: list[zmq.Frame], limits: WireLimits) -> Message:
    if frames_nbytes(frames) >= OFFLOAD_BYTES:
        return await asyncio.to_thread(decode, frames, limits=limits)
    return decode(frames, limits=limits)


Inbox = asyncio.Queue[Message | PrefillFailed]


class PeerConnection:
    """One DEALER socket to a prefill endpoint; see the module docstring."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        *,
        stats: TransferStats,
        limits: WireLimits,
        curve: ClientCurve | None,
    ) -> None:
        self.endpoint = endpoint
        self._stats = stats
        self._limits = limits
        self._sock = ctx.socket(zmq.DEALER)
        tune_socket(self._sock, limits)
        if curve is not None:
            configure_client(self._sock, curve.secret_file, curve.server_key(endpoint))
        events = 0
        for event in _FAIL_EVENTS:
            events |= event
        self._monitor = self._sock.get_monitor_socket(events)
        try:
            self._sock.connect(endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._inboxes: dict[str, Inbox] = {}
        self._dedup = DuplicateFilter()
        # Extensions the prefill daemon there supports; None until its pong (treated as none).
        self.features: frozenset[str] | None = None
        self._pings = 0
        self._probes: set[asyncio.Task[None]] = set()
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._watch())]
        self._probe()

    def supports(self, feature: str) -> bool:
        return self.features is not None and feature in self.features

    def open(self, rid: str) -> Inbox:
        inbox: Inbox = asyncio.Queue()
        self._inboxes[rid] = inbox
        return inbox

    def finish(self, rid: str) -> None:
        """The request is over: anything that still arrives for it is late and dropped."""
        self._inboxes.pop(rid, None)
        self._dedup.finish(rid)

    async def send(self, msg: Message) -> None:
        frames = await encode_off_loop(msg)
        await self._sock.send_multipart(frames, copy=False)
        self._stats.record_sent(frames_nbytes(frames), frames_nbytes(frames[1:]))

    def _probe(self) -> None:
        """Queue a ping (delivered once connected); its pong sets :attr:`features`."""
        self.features = None
        self._pings += 1
        ping = Ping("", self._pings)

        async def send() -> None:
            # A queue full for a second: the next reconnect asks again.
            with contextlib.suppress(zmq.ZMQError, TimeoutError):
                async with asyncio.timeout(1.0):  # not wait_for: see decode_client
                    await self.send(ping)

        task = asyncio.create_task(send())
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def close(self) -> None:
        tasks = [*self._tasks, *self._probes]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for rid in list(self._inboxes):
            self._fail(rid, PrefillFailed("client_closed"))
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)

    def _fail(self, rid: str, error: PrefillFailed) -> None:
        inbox = self._inboxes.get(rid)
        if inbox is not None:
            inbox.put_nowait(error)

    async def _receive(self) -> None:
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            try:
                await self._dispatch(frames)
            except Exception:  # one bad message must never stop the receive loop
                log.exception("KV transfer: failed to handle a message from %s", self.endpoint)
                self._stats.record_drop("internal")

    async def _dispatch(self, frames: list[zmq.Frame]) -> None:
        self._stats.record_received(frames_nbytes(frames), frames_nbytes(frames[1:]))
        try:
            msg = await decode_off_loop(frames, self._limits)
        except WireError as e:
            self._stats.record_drop(e.reason)
            if e.rid is not None:  # a corrupt KV page: the transfer cannot complete
                self._fail(e.rid, PrefillFailed("corrupt", str(e)))
            return
        if isinstance(msg, Pong) and not msg.rid:
            if msg.seq == self._pings:  # an older ping's answer may predate a reconnect
                self.features = msg.feature_set
            return
        inbox = self._inboxes.get(msg.rid)
        if inbox is None:
            self._stats.record_drop("late" if self._dedup.is_finished(msg.rid) else "unknown_rid")
        elif not self._dedup.accept(msg.rid, msg.seq):
            self._stats.record_drop("duplicate")
        else:
            inbox.put_nowait(msg)

    async def _watch(self) -> None:
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._probe()  # whatever answers after the reconnect may be another version
            reason = _FAIL_EVENTS.get(event["event"])
            if reason is None or not self._inboxes:
                continue  # reconnect attempts to an idle dead peer are not news
            log.warning("KV transfer: %s on %s", reason, self.endpoint)
            for rid in list(self._inboxes):
                self._fail(rid, PrefillFailed(reason, self.endpoint))

    async def send_abort(self, msg: Message) -> None:
        """Best effort: a dead peer must not delay freeing our blocks."""
        with contextlib.suppress(zmq.ZMQError, TimeoutError):
            async with asyncio.timeout(1.0):  # not wait_for: see decode_client
                await self.send(msg)
