"""Decode side of disaggregated serving: have a prefill daemon compute a prompt's KV, import it.

:meth:`RemotePrefillClient.prefill` reserves blocks in the local engine (reusing its prefix
cache), asks the prefill server for only the blocks it lacks, writes each arriving KV chunk
into the cache while later chunks are still on the wire, checks that every block of every layer
arrived, and commits the first token so the engine starts decoding. Any failure sends an
``abort`` to the peer, frees the reserved blocks and raises :class:`PrefillFailed`; the caller
then retries on another peer or prefills locally.

Towards a prefill daemon that supports ``kv_pull`` it offers the blocks its cache held
(``offers_pages``): they stay pinned by the reserved request until commit or abort, and each is
sent at most once when the prefill side asks for it (``kv_pull``, answered with ``kv``
messages, or an ``error`` when the ask is not for offered blocks).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import zmq.asyncio
from msgspec import UNSET

from edgeinfer.daemon.engine.async_engine import AsyncEngine
from edgeinfer.daemon.engine.errors import EngineError, InvalidRequestError
from edgeinfer.daemon.engine.llm_engine import LLMEngine
from edgeinfer.daemon.engine.outputs import RequestOutput, TokenLogprob
from edgeinfer.daemon.engine.sampling_params import SamplingParams
from edgeinfer.daemon.kv_transfer.messages import (
    FEATURE_KV_PULL,
    Abort,
    ErrorReply,
    FirstToken,
    KVChunk,
    KVPull,
    PrefillRequest,
)
from edgeinfer.daemon.kv_transfer.page_chunks import (
    ChunkRejected,
    check_chunk,
    chunk_importer,
    page_chunks,
)
from edgeinfer.daemon.kv_transfer.stats import TransferStats
from edgeinfer.daemon.kv_transfer.tensor_codec import wire_layout
from edgeinfer.daemon.kv_transfer.transport import (
    ClientCurve,
    Inbox,
    PeerConnection,
    PrefillFailed,
)
from edgeinfer.daemon.kv_transfer.wire import DEFAULT_LIMITS, WireLimits

__all__ = ["ClientCurve", "PrefillFailed", "RemotePrefillClient"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Exchange:
    """One request's state on this side."""

    offered: int = 0  # leading blocks offered to kv_pull (0: none)
    served: set[int] = dataclasses.field(default_factory=set)  # offered blocks already sent
    next_seq: int = 1  # outgoing: the prefill_req was 0
    received: int = 0  # messages accepted from the peer (kv_pull and kv)
    imports: list[asyncio.Task[None]] = dataclasses.field(default_factory=list)


class RemotePrefillClient:
    """Remote prefill for one decode engine; one DEALER per prefill endpoint, reused."""

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        ctx: zmq.asyncio.Context | None = None,
        curve: ClientCurve | None = None,
        stats: TransferStats | None = None,
        timeout_s: float = 10.0,
        limits: WireLimits = DEFAULT_LIMITS,
        chunk_bytes: int = 4 << 20,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._engine = engine
        self._own_ctx = ctx is None
        self._ctx = ctx if ctx is not None else zmq.asyncio.Context()
        self._curve = curve
        self.stats = stats if stats is not None else TransferStats()
        self._timeout_s = timeout_s
        self._limits = limits
        self._chunk_bytes = chunk_bytes
        self._layout = wire_layout(engine.engine.kv_layout)
        self._peers: dict[str, PeerConnection] = {}

    async def prefill(
        self,
        rid: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        endpoint: str,
        *,
        cache_salt: str | None = None,
    ) -> RequestOutput:
        """Prefill ``prompt_ids`` at ``endpoint`` and start decoding ``rid`` locally; both
        sides' prefix caches apply ``cache_salt``.

        Returns the first token's output; later outputs go to the stream the caller opened
        with ``engine.open_stream(rid)`` beforehand. Raises :class:`PrefillFailed` (blocks
        already freed, ``rid`` reusable) or, for a request the engine rejects outright,
        ``InvalidRequestError``.
        """
        prompt = list(prompt_ids)
        try:
            peer = self._peer(endpoint)
        except zmq.ZMQError as e:  # an endpoint libzmq cannot parse or resolve
            self.stats.record_failure("bad_endpoint")
            raise PrefillFailed("bad_endpoint", f"{endpoint}: {e}") from e
        try:
            cached = await self._engine.call(
                lambda e: e.reserve_remote(rid, prompt, params, cache_salt=cache_salt)
            )
        except InvalidRequestError:
            raise
        except EngineError as e:
            self.stats.record_failure("no_kv_space")
            raise PrefillFailed("no_kv_space", str(e)) from e
        self.stats.transfers_started += 1
        started = time.monotonic()
        inbox = peer.open(rid)
        exchange = _Exchange()
        try:
            out = await self._transfer(
                peer, inbox, exchange, rid, prompt, params, cached, cache_salt
            )
        except BaseException as e:  # cancellation included: the blocks must be freed
            failure = _as_failure(e)
            reason = failure.reason if failure is not None else "cancelled"
            self.stats.record_failure(reason)
            await self._abandon(peer, rid, exchange, reason)
            if failure is None or failure is e:
                raise
            raise failure from e
        finally:
            peer.finish(rid)
        self.stats.record_ok(time.monotonic() - started)
        return out

    def connect(self, endpoint: str) -> None:
        """Open the connection to ``endpoint`` ahead of its first request, so that its pong
        (what it supports) is in by then. Raises ``zmq.ZMQError`` for a bad endpoint."""
        self._peer(endpoint)

    def peer_features(self, endpoint: str) -> frozenset[str] | None:
        """What the prefill daemon at ``endpoint`` said it supports; None before its pong."""
        peer = self._peers.get(endpoint)
        return peer.features if peer is not None else None

    async def close(self) -> None:
        peers, self._peers = list(self._peers.values()), {}
        await asyncio.gather(*(p.close() for p in peers))
        if self._own_ctx:
            self._ctx.term()

    def _peer(self, endpoint: str) -> PeerConnection:
        peer = self._peers.get(endpoint)
        if peer is None:
            peer = self._peers[endpoint] = PeerConnection(
                self._ctx, endpoint, stats=self.stats, limits=self._limits, curve=self._curve
            )
        return peer

    async def _transfer(
        self,
        peer: PeerConnection,
        inbox: Inbox,
        exchange: _Exchange,
        rid: str,
        prompt: list[int],
        params: SamplingParams,
        cached_tokens: int,
        cache_salt: str | None,
    ) -> RequestOutput:
        layout = self._layout
        held = cached_tokens // layout.block_size
        total = -(-len(prompt) // layout.block_size)
        # Blocks still owed per layer; FirstToken is accepted only once all are empty.
        missing = [set(range(held, total)) for _ in range(layout.num_layers)]
        sampling = dataclasses.asdict(params)
        # The wire's maps are str -> scalar: logit_bias travels as OpenAI writes it.
        sampling["logit_bias"] = {str(t): b for t, b in params.logit_bias}
        # Only towards a peer that said it pulls: an older one refuses the field.
        exchange.offered = held if held and peer.supports(FEATURE_KV_PULL) else 0
        await peer.send(
            PrefillRequest(
                rid,
                0,
                tuple(prompt),
                sampling,
                tuple(range(held)),
                layout,
                cache_salt if cache_salt is not None else UNSET,
                offers_pages=exchange.offered > 0,
            )
        )
        imports = exchange.imports
        while True:
            try:
                # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation
                # that races with the awaited result (a client disconnect would go unnoticed).
                async with asyncio.timeout(self._timeout_s):
                    msg = await inbox.get()
            except TimeoutError:
                raise PrefillFailed("timeout", f"nothing from {peer.endpoint}") from None
            if isinstance(msg, PrefillFailed):
                raise msg
            if isinstance(msg, KVChunk):
                try:
                    start = check_chunk(msg, layout, missing)
                except ChunkRejected as e:
                    raise PrefillFailed("bad_chunk", str(e)) from None
                # Not awaited: imports queue up in the engine thread (in order) while the next
                # chunk is received, instead of each waiting for a decode step boundary.
                imports.append(
                    asyncio.create_task(self._engine.call(chunk_importer(rid, msg, start)))
                )
                exchange.received += 1
            elif isinstance(msg, KVPull):
                exchange.received += 1
                await self._serve_pull(peer, rid, msg, exchange)
            elif isinstance(msg, FirstToken):
                if msg.seq != exchange.received or any(missing):
                    raise PrefillFailed(
                        "incomplete_kv", f"first token after {exchange.received} messages"
                    )
                try:
                    await asyncio.gather(*imports)
                except EngineError as e:
                    raise PrefillFailed("import_failed", str(e)) from e
                return await self._engine.call(_committer(rid, msg, len(prompt)))
            elif isinstance(msg, ErrorReply):
                raise PrefillFailed("remote_error", f"{msg.code}: {msg.message}", code=msg.code)
            else:
                self.stats.record_drop("unexpected_kind")

    async def _serve_pull(
        self, peer: PeerConnection, rid: str, msg: KVPull, exchange: _Exchange
    ) -> None:
        """Send the asked pages; refuse (``error``) an ask beyond the offer or repeated, so a
        peer cannot make this side read or send a block twice."""
        blocks = msg.blocks
        start, stop = blocks[0], blocks[-1] + 1
        refusal = None
        if list(blocks) != list(range(start, stop)) or stop > exchange.offered:
            refusal = (
                f"blocks {start}..{stop - 1} are not one run of the {exchange.offered} offered"
            )
        elif exchange.served.intersection(blocks):
            refusal = "blocks asked twice"
        else:
            exchange.served.update(blocks)
            try:
                pages = await self._engine.call(lambda e: e.export_kv(rid, start, stop))
            except EngineError as e:
                refusal = str(e)
        if refusal is not None:
            self.stats.record_drop("bad_pull")
            await peer.send(ErrorReply(rid, exchange.next_seq, "pull_refused", refusal))
            exchange.next_seq += 1
            return
        for chunk in page_chunks(
            rid, exchange.next_seq, start, pages, self._layout, self._chunk_bytes
        ):
            await peer.send(chunk)
            exchange.next_seq += 1
        self.stats.pulled_blocks += stop - start

    async def _abandon(
        self, peer: PeerConnection, rid: str, exchange: _Exchange, reason: str
    ) -> None:
        imports = exchange.imports
        for task in imports:
            task.cancel()  # queued imports not yet run are skipped by the engine thread
        await asyncio.gather(*imports, return_exceptions=True)
        await peer.send_abort(Abort(rid, exchange.next_seq, reason))
        with contextlib.suppress(EngineError):  # a dead engine has no blocks to leak
            # Shielded: a second cancellation must not leave the reserved blocks allocated.
            await asyncio.shield(self._engine.call(lambda e: e.abort_request(rid)))


def _as_failure(exc: BaseException) -> PrefillFailed | None:
    """The PrefillFailed to raise for ``exc``; None for cancellation (re-raised as is)."""
    if isinstance(exc, PrefillFailed):
        return exc
    if isinstance(exc, Exception):
        # Engine or socket trouble mid-transfer: still a failed remote prefill that the
        # caller can fall back from; the cause stays chained for the log.
        log.exception("KV transfer: remote prefill failed unexpectedly")
        return PrefillFailed("internal", repr(exc))
    return None


def _committer(rid: str, msg: FirstToken, prompt_len: int) -> Callable[[LLMEngine], RequestOutput]:
    logprob = None
    if msg.logprob is not None:
        logprob = TokenLogprob(msg.token, msg.logprob, msg.top_logprobs)
    # The prompt tokens the prefill side did not compute came from its prefix cache.
    cached = prompt_len - msg.num_computed
    return lambda engine: engine.commit_remote(rid, msg.token, logprob, num_cached_tokens=cached)
