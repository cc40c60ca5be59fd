"""Decode side of disaggregated serving: have a prefill daemon compute a prompt's KV, import it.

:meth:`RemotePrefillClient.prefill` reserves blocks in the local engine (reusing its prefix
cache), asks the prefill server for only the blocks it lacks, writes each arriving KV chunk
into the cache while later chunks are still on the wire, checks that every block of every layer
arrived, and commits the first token so the engine starts decoding. Any failure sends an
``abort`` to the peer, frees the reserved blocks and raises :class:`PrefillFailed`; the caller
then retries on another peer or prefills locally.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import torch
import zmq.asyncio

from edgeinfer.daemon.engine.async_engine import AsyncEngine
from edgeinfer.daemon.engine.errors import EngineError, InvalidRequestError
from edgeinfer.daemon.engine.llm_engine import LLMEngine
from edgeinfer.daemon.engine.outputs import RequestOutput, TokenLogprob
from edgeinfer.daemon.engine.sampling_params import SamplingParams
from edgeinfer.daemon.kv_transfer.messages import (
    Abort,
    ErrorReply,
    FirstToken,
    KVChunk,
    PrefillRequest,
    WireLayout,
)
from edgeinfer.daemon.kv_transfer.stats import TransferStats
from edgeinfer.daemon.kv_transfer.tensor_codec import page_shape, payload_tensor, wire_layout
from edgeinfer.daemon.kv_transfer.transport import (
    ClientCurve,
    Inbox,
    PeerConnection,
    PrefillFailed,
)
from edgeinfer.daemon.kv_transfer.wire import DEFAULT_LIMITS, WireLimits

__all__ = ["ClientCurve", "PrefillFailed", "RemotePrefillClient"]

log = logging.getLogger(__name__)


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
        imports: list[asyncio.Task[None]] = []
        try:
            out = await self._transfer(
                peer, inbox, imports, rid, prompt, params, cached, cache_salt
            )
        except BaseException as e:  # cancellation included: the blocks must be freed
            failure = _as_failure(e)
            reason = failure.reason if failure is not None else "cancelled"
            self.stats.record_failure(reason)
            await self._abandon(peer, rid, imports, reason)
            if failure is None or failure is e:
                raise
            raise failure from e
        finally:
            peer.finish(rid)
        self.stats.record_ok(time.monotonic() - started)
        return out

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
        imports: list[asyncio.Task[None]],
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
        await peer.send(
            PrefillRequest(rid, 0, tuple(prompt), sampling, tuple(range(held)), layout, cache_salt)
        )
        num_chunks = 0
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
                start = _check_chunk(msg, layout, missing)
                tensors = [
                    payload_tensor(buf, msg.dtype, shape)
                    for buf, shape in zip(msg.payloads, msg.shapes)
                ]
                # Not awaited: imports queue up in the engine thread (in order) while the next
                # chunk is received, instead of each waiting for a decode step boundary.
                job = _importer(rid, start, msg.layers[0], tensors)
                imports.append(asyncio.create_task(self._engine.call(job)))
                num_chunks += 1
            elif isinstance(msg, FirstToken):
                if msg.seq != num_chunks or any(missing):
                    raise PrefillFailed("incomplete_kv", f"first token after {num_chunks} chunks")
                try:
                    await asyncio.gather(*imports)
                except EngineError as e:
                    raise PrefillFailed("import_failed", str(e)) from e
                return await self._engine.call(_committer(rid, msg, len(prompt)))
            elif isinstance(msg, ErrorReply):
                raise PrefillFailed("remote_error", f"{msg.code}: {msg.message}", code=msg.code)
            else:
                self.stats.record_drop("unexpected_kind")

    async def _abandon(
        self, peer: PeerConnection, rid: str, imports: list[asyncio.Task[None]], reason: str
    ) -> None:
        for task in imports:
            task.cancel()  # queued imports not yet run are skipped by the engine thread
        await asyncio.gather(*imports, return_exceptions=True)
        await peer.send_abort(Abort(rid, 1, reason))
        with contextlib.suppress(EngineError):  # a dead engine has no blocks to leak
            # Shielded: a second cancellation must not leave the reserved blocks allocated.
            await asyncio.shield(self._engine.call(lambda e: e.abort_request(rid)))


def _check_chunk(msg: KVChunk, layout: WireLayout, missing: list[set[int]]) -> int:
    """Validate a chunk against what this request still needs; return its first block."""
    start, stop = msg.layers
    blocks = msg.blocks
    if msg.dtype != layout.dtype or stop > layout.num_layers or not blocks:
        raise PrefillFailed("bad_chunk", f"dtype {msg.dtype}, layers {msg.layers}")
    if list(blocks) != list(range(blocks[0], blocks[0] + len(blocks))):
        raise PrefillFailed("bad_chunk", "blocks are not one ascending run")
    want = page_shape(layout, len(blocks))
    # Two payloads (K then V) per layer, each [n, block_size, Hkv, D].
    if len(msg.shapes) != 2 * (stop - start) or any(s != want for s in msg.shapes):
        raise PrefillFailed("bad_chunk", f"shapes {msg.shapes[:2]} for {want}")
    needed = set(blocks)
    for layer in range(start, stop):
        if not needed <= missing[layer]:
            raise PrefillFailed("bad_chunk", f"layer {layer} blocks not owed (or sent twice)")
        missing[layer] -= needed
    return blocks[0]


def _importer(
    rid: str, start_block: int, first_layer: int, tensors: list[torch.Tensor]
) -> Callable[[LLMEngine], None]:
    def run(engine: LLMEngine) -> None:
        for i in range(0, len(tensors), 2):
            engine.import_kv(rid, start_block, first_layer + i // 2, tensors[i], tensors[i + 1])

    return run


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
