"""Prefill side of disaggregated serving: compute prompts for decode daemons, push their KV.

One ROUTER socket serves every decode peer. Each valid ``prefill_req`` becomes a task that runs
the prompt as a prefill-only engine request and, every time a step completes more blocks,
exports those blocks at once and sends them as ``kv`` chunks (a run of blocks x a group of
layers each), so the wire and the decode side's import overlap the remaining prefill compute.
Blocks the decode side already holds (``held_blocks``) are never sent. When the decode side
offers those blocks (``offers_pages``) and they reach beyond this daemon's own prefix-cache
hits, the extra ones may first be received from it instead of recomputed (:mod:`.prefill_pull`);
its answers (``kv``, ``error``) from the same peer go to that transfer. The first token goes
last, then the blocks are released. Every exit path (success, peer abort, peer gone, timeout,
server stop) releases the request's blocks.

Request ids must be unique across all decode daemons (uuid4): the server keys transfers and
duplicate detection by rid, which is what makes a replayed ``prefill_req`` harmless.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio
from zmq.auth.thread import ThreadAuthenticator

from edgeinfer.daemon.engine.async_engine import AsyncEngine
from edgeinfer.daemon.engine.errors import EngineError, InvalidRequestError
from edgeinfer.daemon.engine.llm_engine import LLMEngine
from edgeinfer.daemon.engine.outputs import RequestOutput
from edgeinfer.daemon.engine.sampling_params import SamplingParams
from edgeinfer.daemon.kv_transfer.dedup import DuplicateFilter
from edgeinfer.daemon.kv_transfer.errors import WireError
from edgeinfer.daemon.kv_transfer.messages import (
    FEATURE_KV_PULL,
    Abort,
    ErrorReply,
    FirstToken,
    KVChunk,
    Message,
    Ping,
    Pong,
    PrefillRequest,
)
from edgeinfer.daemon.kv_transfer.prefill_pull import KVPuller, PullFailed, PullInbox
from edgeinfer.daemon.kv_transfer.prefill_push import KVPusher, PeerGone
from edgeinfer.daemon.kv_transfer.pull_price import DEFAULT_PRICES, PullPrices, measured_prices
from edgeinfer.daemon.kv_transfer.security import configure_server, start_authenticator
from edgeinfer.daemon.kv_transfer.stats import TransferStats
from edgeinfer.daemon.kv_transfer.tensor_codec import layout_mismatch, wire_layout
from edgeinfer.daemon.kv_transfer.transport import (
    ServerCurve,
    decode_off_loop,
    encode_off_loop,
    frames_nbytes,
    tune_socket,
)
from edgeinfer.daemon.kv_transfer.wire import DEFAULT_LIMITS, WireLimits

__all__ = ["PrefillServer", "ServerCurve"]

log = logging.getLogger(__name__)

ENGINE_ID_PREFIX = "kvx:"  # keeps remote rids apart from the daemon's own local requests


@dataclass
class _Transfer:
    identity: bytes  # the ROUTER routing id of the decode peer that asked
    task: asyncio.Task[None]
    aborted: bool = False
    pull_inbox: PullInbox | None = None  # set while pulling pages from the peer


class PrefillServer:
    def __init__(
        self,
        engine: AsyncEngine,
        bind: str,
        *,
        ctx: zmq.asyncio.Context | None = None,
        curve: ServerCurve | None = None,
        stats: TransferStats | None = None,
        limits: WireLimits = DEFAULT_LIMITS,
        request_timeout_s: float = 120.0,
        send_timeout_s: float = 10.0,
        chunk_bytes: int = 4 << 20,
        max_in_flight: int = 64,
        listen_fd: int | None = None,
        pull: bool = True,
        prefill_rate: Callable[[], float] | None = None,
        pull_defaults: PullPrices = DEFAULT_PRICES,
        pull_timeout_s: float = 2.0,
    ) -> None:
        """``listen_fd``: a TCP socket already bound and listening (the daemon binds its ports
        at start-up) that ZeroMQ adopts instead of binding ``bind`` itself. ``pull``: accept
        offered pages (:mod:`.prefill_pull`) where :mod:`.pull_price` finds it faster, with
        ``prefill_rate`` (the daemon's measured prompt tokens/s; 0 or None: unmeasured) and the
        link this server measured on earlier pulls, ``pull_defaults`` where unmeasured;
        ``pull_timeout_s`` is the longest wait for the next pulled page before recomputing
        (well under the decode side's ``timeout_s``, which runs meanwhile)."""
        self._engine = engine
        self._bind = bind
        self._listen_fd = listen_fd
        self._own_ctx = ctx is None
        self._ctx = ctx if ctx is not None else zmq.asyncio.Context()
        self._curve = curve
        self.stats = stats if stats is not None else TransferStats()
        self._limits = limits
        self._request_timeout_s = request_timeout_s
        self._send_timeout_s = send_timeout_s
        self._chunk_bytes = chunk_bytes
        self._max_in_flight = max_in_flight
        self._layout = wire_layout(engine.engine.kv_layout)
        self._transfers: dict[str, _Transfer] = {}
        self._dedup = DuplicateFilter()
        self._replies: set[asyncio.Task[None]] = set()
        self._sock: zmq.asyncio.Socket | None = None
        self._auth: ThreadAuthenticator | None = None
        self._receiver: asyncio.Task[None] | None = None
        self._draining = False
        self._pull = pull
        self._prefill_rate = prefill_rate
        self._pull_defaults = pull_defaults
        self._pull_timeout_s = pull_timeout_s
        self.endpoint = ""  # the bound address, port resolved (bind to tcp://host:* in tests)

    @property
    def in_flight(self) -> int:
        return len(self._transfers)

    def set_draining(self, draining: bool) -> None:
        """While draining, new prefill requests get a ``draining`` error; transfers in flight
        run to the end (an operator's drain must not cut a decode daemon's KV in half)."""
        self._draining = draining

    async def start(self) -> None:
        sock = self._ctx.socket(zmq.ROUTER)
        tune_socket(sock, self._limits)
        # Sending to a peer that is gone raises EHOSTUNREACH instead of silently dropping the
        # KV, so its transfer stops and releases its blocks at once.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if self._curve is not None:
            self._auth = start_authenticator(self._ctx, self._curve.allowed_clients_dir)
            configure_server(sock, self._curve.secret_file)
        if self._listen_fd is not None:
            sock.setsockopt(zmq.USE_FD, self._listen_fd)
        sock.bind(self._bind)
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sock = sock
        self._receiver = asyncio.create_task(self._receive(sock))

    async def stop(self, drain: bool = True, timeout_s: float = 30.0) -> None:
        """Stop serving. ``drain``: refuse new requests but let in-flight transfers finish
        (up to ``timeout_s``); otherwise, or after that, cancel them (blocks released)."""
        self._draining = True
        tasks = [t.task for t in self._transfers.values()]
        if drain and tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._receiver is not None:
            self._receiver.cancel()
            await asyncio.gather(self._receiver, *self._replies, return_exceptions=True)
        if self._sock is not None:
            # Drained transfers' last messages may still sit in libzmq's queue: let them out.
            self._sock.close(linger=1000 if drain else 0)
            self._sock = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._own_ctx and not self._ctx.closed:
            self._ctx.term()

    # ---- receiving ------------------------------------------------------------------
    async def _receive(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart(copy=False)
            try:
                await self._handle(frames)
            except Exception:  # one bad message must never stop the server
                log.exception("KV transfer: failed to handle a message")
                self.stats.record_drop("internal")

    async def _handle(self, frames: list[zmq.Frame]) -> None:
        identity, body = frames[0].bytes, frames[1:]
        self.stats.record_received(frames_nbytes(body), frames_nbytes(body[1:]))
        try:
            # In order: the next message is read only once this one is handled.
            msg = await decode_off_loop(body, self._limits)
        except WireError as e:
            self.stats.record_drop(e.reason)
            transfer = self._transfers.get(e.rid) if e.rid is not None else None
            if transfer is None and e.rid is not None:
                # Answer rather than let the peer wait out its timeout for nothing.
                self._reply(identity, ErrorReply(e.rid, 0, e.reason, str(e)))
            elif transfer is not None and transfer.identity == identity and transfer.pull_inbox:
                transfer.pull_inbox.put_nowait(PullFailed("corrupt", str(e)))
            return
        if isinstance(msg, PrefillRequest):
            self._on_prefill(identity, msg)
        elif isinstance(msg, KVChunk | ErrorReply):
            self._on_pull_reply(identity, msg)
        elif isinstance(msg, Abort):
            self._on_abort(identity, msg)
        elif isinstance(msg, Ping):
            features = (FEATURE_KV_PULL,) if self._pull else ()
            self._reply(identity, Pong(msg.rid, msg.seq, features))
        else:
            self.stats.record_drop("unexpected_kind")

    def _on_prefill(self, identity: bytes, req: PrefillRequest) -> None:
        rid = req.rid
        if self._dedup.is_finished(rid):
            self.stats.record_drop("late")
            return
        if req.seq != 0 or rid in self._transfers or not self._dedup.accept(rid, req.seq):
            self.stats.record_drop("duplicate")
            return
        params = self._admit(req)
        if isinstance(params, tuple):
            self._dedup.finish(rid)
            self.stats.record_failure(params[0])
            self._reply(identity, ErrorReply(rid, 0, *params))
            return
        task = asyncio.create_task(self._serve(identity, req, params))
        self._transfers[rid] = _Transfer(identity, task)
        task.add_done_callback(lambda _: self._finished(rid))

    def _admit(self, req: PrefillRequest) -> SamplingParams | tuple[str, str]:
        """The request's parameters, or (code, message) of the error reply refusing it."""
        if self._draining:
            return "draining", "prefill server is shutting down"
        if len(self._transfers) >= self._max_in_flight:
            return "busy", f"{self._max_in_flight} transfers in flight"
        mismatch = layout_mismatch(self._layout, req.layout)
        if mismatch is not None:
            return "layout_mismatch", mismatch
        fields: dict[str, Any] = req.sampling  # checked by SamplingParams itself
        try:
            return SamplingParams(**fields)
        except (TypeError, InvalidRequestError) as e:
            return "bad_params", str(e)

    def _on_abort(self, identity: bytes, msg: Abort) -> None:
        transfer = self._transfers.get(msg.rid)
        if transfer is None:
            self.stats.record_drop("late" if self._dedup.is_finished(msg.rid) else "unknown_rid")
        elif transfer.identity != identity:
            self.stats.record_drop("foreign_abort")  # only the requesting peer may abort
        elif not self._dedup.accept(msg.rid, msg.seq):
            self.stats.record_drop("duplicate")
        else:
            transfer.aborted = True
            transfer.task.cancel()  # its finally releases the blocks (if it got any)
            self.stats.record_failure("aborted_by_peer")

    def _on_pull_reply(self, identity: bytes, msg: KVChunk | ErrorReply) -> None:
        transfer = self._transfers.get(msg.rid)
        if transfer is None:
            self.stats.record_drop("late" if self._dedup.is_finished(msg.rid) else "unknown_rid")
        elif transfer.identity != identity:
            self.stats.record_drop("foreign_reply")  # only the requesting peer holds its pages
        elif not self._dedup.accept(msg.rid, msg.seq):
            self.stats.record_drop("duplicate")
        elif transfer.pull_inbox is None:
            self.stats.record_drop("unexpected_kind")  # no pull asked, or it was given up
        else:
            transfer.pull_inbox.put_nowait(msg)

    def _finished(self, rid: str) -> None:
        self._transfers.pop(rid, None)
        self._dedup.finish(rid)

    # ---- serving one request --------------------------------------------------------
    async def _serve(self, identity: bytes, req: PrefillRequest, params: SamplingParams) -> None:
        engine_rid = ENGINE_ID_PREFIX + req.rid
        send = functools.partial(self._send, identity)
        pusher = KVPusher(self._engine, engine_rid, req, self._layout, self._chunk_bytes, send)
        puller = KVPuller(
            self._engine,
            engine_rid,
            req,
            self._layout,
            send,
            stats=self.stats,
            prices=self._pull_prices,
            timeout_s=self._pull_timeout_s,
            # With CURVE every peer proved a key of the allow-list; without, anyone who reaches
            # this port could plant pages in a cache other tenants read (any salt it names).
            cacheable=self._curve is not None,
        )
        self.stats.transfers_started += 1
        started = time.monotonic()
        try:
            async with asyncio.timeout(self._request_timeout_s):
                if params.structured is not None:
                    # The first token obeys the request's grammar; compiled off the event loop
                    # (and off the engine thread, which then finds it cached).
                    grammars = self._engine.engine.grammars
                    await asyncio.to_thread(grammars.compile, params.structured)
                outputs = None
                if self._pull and puller.offered_blocks:
                    outputs = await self._pull_pages(req.rid, puller, pusher, params)
                final = await pusher.run(params, outputs)
                token = FirstToken(
                    req.rid,
                    pusher.seq,
                    final.new_token_ids[0],
                    final.new_logprobs[0].logprob if final.new_logprobs else None,
                    final.new_logprobs[0].top if final.new_logprobs else (),
                    # What this side computed: the decode side reports the rest as cached.
                    len(req.prompt) - final.num_cached_tokens,
                    False,  # stop conditions are the decode side's to apply
                )
                await send(token)
            self.stats.record_ok(time.monotonic() - started)
        except asyncio.CancelledError:
            transfer = self._transfers.get(req.rid)
            if transfer is None or not transfer.aborted:
                self.stats.record_failure("server_stopped")
                raise
        except TimeoutError:
            self.stats.record_failure("timeout")
            self._reply(identity, ErrorReply(req.rid, pusher.seq, "timeout", "prefill timed out"))
        except PeerGone:
            self.stats.record_failure("peer_gone")
        except Exception as e:  # engine refusal, or a bug: answer so the peer can fall back
            code = "invalid_request" if isinstance(e, InvalidRequestError) else "engine_error"
            if not isinstance(e, EngineError):
                code = "internal"
                log.exception("KV transfer: prefill of %r failed", req.rid)
            self.stats.record_failure(code)
            self._reply(identity, ErrorReply(req.rid, pusher.seq, code, str(e)))
        finally:
            await self._free(engine_rid)

    async def _pull_pages(
        self, rid: str, puller: KVPuller, pusher: KVPusher, params: SamplingParams
    ) -> AsyncGenerator[RequestOutput, None] | None:
        transfer = self._transfers[rid]
        transfer.pull_inbox = asyncio.Queue()
        try:
            return await puller.run(params, transfer.pull_inbox)
        finally:
            transfer.pull_inbox = None  # what still arrives for the pull is dropped
            pusher.seq = puller.seq  # the kv_pull took a number in this direction

    def _pull_prices(self) -> PullPrices:
        rate = self._prefill_rate() if self._prefill_rate is not None else None
        stats = self.stats
        return measured_prices(
            rate, stats.pull_link_bytes_per_s, stats.pull_rtt_s, self._pull_defaults
        )

    async def _free(self, engine_rid: str) -> None:
        def drop(engine: LLMEngine) -> None:
            try:
                engine.release(engine_rid)  # prefilled: KV shipped (or the peer gave up)
            except EngineError:
                engine.abort_request(engine_rid)  # still computing, or never added

        with contextlib.suppress(EngineError):  # a dead engine has no blocks to leak
            # Shielded so that a second cancellation (server stop) cannot skip the release.
            await asyncio.shield(self._engine.call(drop))

    async def _send(self, identity: bytes, msg: Message) -> None:
        if self._sock is None:
            raise PeerGone("server is not started")
        frames = await encode_off_loop(msg)
        try:
            async with asyncio.timeout(self._send_timeout_s):  # not wait_for: see decode_client
                await self._sock.send_multipart([identity, *frames], copy=False)
        except zmq.ZMQError as e:  # EHOSTUNREACH: the peer disconnected (ROUTER_MANDATORY)
            raise PeerGone(str(e)) from e
        except TimeoutError as e:  # the peer stopped reading: treat as gone, free the blocks
            raise PeerGone("send timed out") from e
        payload = frames_nbytes(frames[1:])
        self.stats.record_sent(frames_nbytes(frames), payload)

    def _reply(self, identity: bytes, msg: Message) -> None:
        """Fire-and-forget error/pong reply; a vanished peer is simply not answered."""

        async def send() -> None:
            with contextlib.suppress(PeerGone):
                await self._send(identity, msg)

        task = asyncio.create_task(send())
        self._replies.add(task)
        task.add_done_callback(self._replies.discard)
