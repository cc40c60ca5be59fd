"""Run one prefill-only request and push its KV blocks to the decode peer as they complete.

Used by :class:`~.prefill_server.PrefillServer`, one :class:`KVPusher` per transfer. Each engine
output says how many leading blocks are complete (``kv_blocks_ready``); the newly complete ones
are exported in one engine call (one step boundary) and sent as chunks (:mod:`.page_chunks`).
Chunk ``seq`` numbers start where the caller says (after its ``kv_pull``, if it sent one); the
caller sends the first token with the final :attr:`KVPusher.seq`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable

from edgeinfer.daemon.engine.async_engine import AsyncEngine
from edgeinfer.daemon.engine.errors import EngineError
from edgeinfer.daemon.engine.outputs import RequestOutput
from edgeinfer.daemon.engine.sampling_params import SamplingParams
from edgeinfer.daemon.kv_transfer.errors import KVTransferError
from edgeinfer.daemon.kv_transfer.messages import Message, PrefillRequest, WireLayout
from edgeinfer.daemon.kv_transfer.page_chunks import Pages, page_chunks

SendFn = Callable[[Message], Awaitable[None]]


class PeerGone(KVTransferError):
    """The decode peer disconnected or stopped reading; its transfer is abandoned."""


class KVPusher:
    def __init__(
        self,
        engine: AsyncEngine,
        engine_rid: str,
        req: PrefillRequest,
        layout: WireLayout,
        chunk_bytes: int,
        send: SendFn,
    ) -> None:
        self._engine = engine
        self._engine_rid = engine_rid
        self._req = req
        self._layout = layout
        self._send = send
        self._chunk_bytes = chunk_bytes
        # The decode side reserves blocks for the prompt only; never send beyond them.
        self._total = -(-len(req.prompt) // layout.block_size)
        self._held = frozenset(req.held_blocks)
        self._done = 0  # blocks [0, _done) are sent or held by the peer
        self.seq = 0  # next outgoing sequence number

    async def run(
        self,
        params: SamplingParams,
        outputs: AsyncGenerator[RequestOutput, None] | None = None,
    ) -> RequestOutput:
        """Prefill, pushing blocks as they complete; return the final (first-token) output.
        ``outputs``: those of a request already in the engine (its pulled pages in place);
        None adds the request."""
        final: RequestOutput | None = None
        req = self._req
        # The decode side's salt: this cache keeps the requests of different salts apart too.
        gen = outputs or self._engine.generate(
            self._engine_rid, req.prompt, params, prefill_only=True, cache_salt=req.salt
        )
        # aclosing: if we are cancelled mid-send, the engine request is aborted right away.
        async with contextlib.aclosing(gen) as outputs:
            async for out in outputs:
                await self._push(min(out.kv_blocks_ready, self._total), final=out.finished)
                if out.finished:
                    final = out
        if final is None or final.finish_reason != "prefilled" or not final.new_token_ids:
            reason = final.finish_reason if final is not None else None
            raise EngineError(f"prefill of {self._req.rid!r} ended with {reason!r}")
        return final

    async def _push(self, ready: int, *, final: bool) -> None:
        while self._done < ready:
            start = self._done
            if start in self._held:
                self._done += 1
                continue
            stop = start + 1
            while stop < ready and stop not in self._held:
                stop += 1
            try:
                pages = await self._engine.call(self._exporter(start, stop))
            except EngineError:
                if final:
                    raise
                return  # preempted since that output: retry once the blocks are ready again
            await self._send_pages(start, stop, pages)
            self._done = stop

    def _exporter(self, start: int, stop: int) -> Callable[..., Pages]:
        rid = self._engine_rid
        return lambda engine: engine.export_kv(rid, start, stop)

    async def _send_pages(self, start: int, stop: int, pages: Pages) -> None:
        for chunk in page_chunks(
            self._req.rid, self.seq, start, pages, self._layout, self._chunk_bytes
        ):
            await self._send(chunk)
            self.seq += 1
