"""Prefill side of ``kv_pull``: receive the leading pages the decode peer holds, instead of
recomputing them.

In a multi-turn chat the decode daemon holds the whole previous turn (prompt and answer, cached
after its import) while the prefill daemon holds only the previous prompt. When the decode
side offers its held blocks (``offers_pages``) and they reach beyond this daemon's own hits,
:class:`KVPuller` prices the pull against recomputing (:mod:`.pull_price`), reserves blocks for
the offered run (``reserve_pull``), asks for the pages it lacks, writes them in as they arrive
and starts the request after them (``start_pulled``); :class:`~.prefill_push.KVPusher` then
computes the rest and pushes what the decode side lacks, as without a pull.

Any failure of the pull (peer gone, timeout, corrupt or unexpected pages, an ``error``
answer) aborts the reservation, which frees its blocks, and the request is computed from
scratch: a pull can cost time, never the answer. Pulled pages join this daemon's prefix cache
only when ``cacheable`` (the peer is authenticated, see the server); otherwise neither they nor
the blocks computed after them (which attended to them) are ever shared with another request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable

from edgeinfer.daemon.engine.async_engine import AsyncEngine
from edgeinfer.daemon.engine.errors import EngineError
from edgeinfer.daemon.engine.outputs import RequestOutput
from edgeinfer.daemon.engine.sampling_params import SamplingParams
from edgeinfer.daemon.kv_transfer.errors import KVTransferError
from edgeinfer.daemon.kv_transfer.messages import (
    ErrorReply,
    KVChunk,
    KVPull,
    PrefillRequest,
    WireLayout,
)
from edgeinfer.daemon.kv_transfer.page_chunks import ChunkRejected, check_chunk, chunk_importer
from edgeinfer.daemon.kv_transfer.prefill_push import SendFn
from edgeinfer.daemon.kv_transfer.pull_price import PullPrices, pull_saves_time
from edgeinfer.daemon.kv_transfer.stats import TransferStats
from edgeinfer.daemon.kv_transfer.tensor_codec import page_bytes

log = logging.getLogger(__name__)


class PullFailed(KVTransferError):
    """The pull did not complete; ``reason`` is a short code. The request is recomputed."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"kv_pull failed: {reason}" + (f" ({detail})" if detail else ""))
        self.reason = reason


PullInbox = asyncio.Queue[KVChunk | ErrorReply | PullFailed]


class KVPuller:
    def __init__(
        self,
        engine: AsyncEngine,
        engine_rid: str,
        req: PrefillRequest,
        layout: WireLayout,
        send: SendFn,
        *,
        stats: TransferStats,
        prices: Callable[[], PullPrices],
        timeout_s: float,
        cacheable: bool,
    ) -> None:
        """``timeout_s``: the longest wait for the next page; ``prices``: what a decision
        weighs, read once per request."""
        self._engine = engine
        self._engine_rid = engine_rid
        self._req = req
        self._layout = layout
        self._send = send
        self._stats = stats
        self._prices = prices
        self._timeout_s = timeout_s
        self._cacheable = cacheable
        self._kv_bytes_per_token = 2 * layout.num_layers * page_bytes(layout) // layout.block_size
        self.seq = 0  # next outgoing sequence number (the pusher continues from it)

    @property
    def offered_blocks(self) -> int:
        """Leading blocks the decode side serves; only a run from block 0 is usable."""
        held = self._req.held_blocks
        if not self._req.offers_pages or held != tuple(range(len(held))):
            return 0
        return len(held)

    async def run(
        self, params: SamplingParams, inbox: PullInbox
    ) -> AsyncGenerator[RequestOutput, None] | None:
        """Pull what is worth pulling and start the request; return its outputs, or None
        when nothing was pulled (not offered, not worth it, or failed: nothing is reserved
        then, and the caller adds the request as usual)."""
        offered = self.offered_blocks
        if offered == 0:
            return None
        req, rid = self._req, self._engine_rid
        prices = self._prices()
        blocks = await self._engine.call(
            lambda e: e.reserve_pull(
                rid,
                req.prompt,
                params,
                cache_salt=req.salt,
                offered_blocks=offered,
                worth_pulling=lambda n: self._worth(n, prices),
            )
        )
        if not blocks:
            return None
        imports: list[asyncio.Task[None]] = []
        try:
            await self._receive(blocks, inbox, imports)
            stream = self._engine.open_stream(rid)
            await self._engine.call(lambda e: e.start_pulled(rid, cacheable=self._cacheable))
        except (PullFailed, EngineError) as e:
            reason = e.reason if isinstance(e, PullFailed) else "engine_error"
            self._stats.pull_fallbacks[reason] += 1
            log.info("kv_pull of %r failed, recomputing: %s", req.rid, e)
            await self._abandon(imports)
            return None
        except BaseException:
            await self._abandon(imports)  # the server's cleanup frees the blocks
            raise
        return self._outputs(stream)

    def _worth(self, blocks: int, prices: PullPrices) -> bool:
        tokens = blocks * self._layout.block_size
        pull = pull_saves_time(tokens, self._kv_bytes_per_token, prices)
        log.debug(
            "kv_pull %r: %d blocks (%d tokens) beyond this cache's hit; prefill %.0f tok/s, "
            "link %.3g B/s, rtt %.1f ms: %s",
            self._req.rid,
            blocks,
            tokens,
            prices.prefill_tokens_per_s,
            prices.link_bytes_per_s,
            prices.rtt_s * 1e3,
            "pull" if pull else "recompute",
        )
        return pull

    async def _receive(
        self, blocks: range, inbox: PullInbox, imports: list[asyncio.Task[None]]
    ) -> None:
        await self._send(KVPull(self._req.rid, self.seq, tuple(blocks)))
        self.seq += 1
        started = time.monotonic()
        first_s = None
        nbytes = 0
        missing = [set(blocks) for _ in range(self._layout.num_layers)]
        while any(missing):
            try:
                async with asyncio.timeout(self._timeout_s):  # not wait_for: see decode_client
                    msg = await inbox.get()
            except TimeoutError:
                raise PullFailed("timeout", f"no page for {self._timeout_s} s") from None
            if isinstance(msg, PullFailed):
                raise msg
            if isinstance(msg, ErrorReply):
                raise PullFailed("refused", f"{msg.code}: {msg.message}")
            try:
                start = check_chunk(msg, self._layout, missing)
            except ChunkRejected as e:
                raise PullFailed("bad_chunk", str(e)) from None
            if first_s is None:
                first_s = time.monotonic() - started
            nbytes += sum(p.nbytes for p in msg.frames)
            # Queued in order in the engine thread while the next chunk is received.
            job = chunk_importer(self._engine_rid, msg, start)
            imports.append(asyncio.create_task(self._engine.call(job)))
        await asyncio.gather(*imports)
        total_s = time.monotonic() - started
        self._stats.record_pull(len(blocks), nbytes, first_s or total_s, total_s)

    async def _abandon(self, imports: list[asyncio.Task[None]]) -> None:
        for task in imports:
            task.cancel()  # queued imports not yet run are skipped by the engine thread
        await asyncio.gather(*imports, return_exceptions=True)
        self._engine.close_stream(self._engine_rid)
        rid = self._engine_rid
        with contextlib.suppress(EngineError):  # a dead engine has no blocks to leak
            # Shielded: a second cancellation must not leave the reserved blocks allocated.
            await asyncio.shield(self._engine.call(lambda e: e.abort_request(rid)))

    async def _outputs(
        self, stream: asyncio.Queue[RequestOutput | BaseException]
    ) -> AsyncGenerator[RequestOutput, None]:
        """The started request's outputs; closing early aborts it (as ``generate`` does)."""
        finished = False
        try:
            async for out in self._engine.iterate(stream):
                finished = out.finished
                yield out
        finally:
            self._engine.close_stream(self._engine_rid)
            if not finished and self._engine.is_alive:
                rid = self._engine_rid
                await self._engine.call(lambda e: e.abort_request(rid))
