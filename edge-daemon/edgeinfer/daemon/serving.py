"""Where the HTTP layer gets a request's outputs: the seam between the API and the engine(s).

:class:`RequestRunner` is the only object the handlers ask for tokens. It decides where a
prompt is prefilled: locally, or (on a decode daemon) by a prefill peer that ships the KV
pages over ZeroMQ. Either way the handlers see one async iterator of :class:`RequestOutput`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable, Sequence

from edgeinfer.daemon.config import DaemonConfig
from edgeinfer.daemon.engine.async_engine import AsyncEngine
from edgeinfer.daemon.engine.outputs import RequestOutput
from edgeinfer.daemon.engine.sampling_params import SamplingParams
from edgeinfer.daemon.kv_transfer.transport import PrefillFailed
from edgeinfer.daemon.metrics import DaemonMetrics
from edgeinfer.daemon.transfer_plane import TransferPlane

log = logging.getLogger(__name__)


class RequestRunner:
    def __init__(
        self,
        engine: AsyncEngine,
        config: DaemonConfig,
        metrics: DaemonMetrics,
        plane: TransferPlane | None = None,
    ) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.plane = plane

    async def run(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        prefill_peer: str | None = None,
        cache_salt: str | None = None,
        local: bool = False,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the outputs of one request until it finishes; ``cache_salt`` (see
        :mod:`~edgeinfer.daemon.api.cache_salt`) keeps its prefix-cache blocks apart.
        ``local`` prefills here whatever peers there are (a later choice of an ``n`` > 1
        request, whose prompt the first choice left in this daemon's prefix cache).

        ``prefill_peer`` is the ZeroMQ endpoint of a prefill daemon the request asked for (the
        ``x-edge-prefill`` header or ``kv_transfer_params.prefill_endpoint``), or None. A
        decode daemon prefills remotely unless the uncached part of the prompt is shorter than
        ``local_prefill_threshold``; when every peer fails it prefills locally. A request that
        asks for prompt logprobs is prefilled locally: the scores come from the prefill's
        logits, which a peer does not send (only KV pages and the first token travel).

        Closing the iterator before the last output aborts the request and frees its KV blocks
        at once; callers must close it (``contextlib.aclosing``) when they stop early.
        """
        timer = self.metrics.timer()
        remote = not local and params.prompt_logprobs is None
        peers = await self._remote_peers(prompt_ids, prefill_peer, cache_salt) if remote else []
        stream = (
            self._run_remote(request_id, prompt_ids, params, peers, cache_salt)
            if peers
            else self.engine.generate(request_id, prompt_ids, params, cache_salt=cache_salt)
        )
        async with contextlib.aclosing(stream):
            async for out in stream:
                timer.observe(out)
                yield out

    async def _remote_peers(
        self, prompt_ids: Sequence[int], requested: str | None, cache_salt: str | None
    ) -> list[str]:
        plane = self.plane
        if plane is None or plane.client is None:
            return []
        peers = plane.prefill_candidates(requested)
        if not peers:
            return []
        ids = list(prompt_ids)
        cached = await self.engine.call(
            lambda e: e.cached_prefix_tokens(ids, cache_salt=cache_salt)
        )
        if len(ids) - cached < self.config.local_prefill_threshold:
            return []  # shipping this little KV costs more than computing it here
        return peers

    async def _run_remote(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        peers: list[str],
        cache_salt: str | None,
    ) -> AsyncGenerator[RequestOutput, None]:
        plane = self.plane
        if plane is None or plane.client is None:
            raise RuntimeError("remote prefill without a transfer client")
        queue = self.engine.open_stream(request_id)
        finished = False
        try:
            first = None
            for peer in peers:
                try:
                    first = await plane.client.prefill(
                        request_id, prompt_ids, params, peer, cache_salt=cache_salt
                    )
                    break
                except PrefillFailed as exc:
                    log.warning("prefill at %s failed (%s): %s", peer, exc.reason, exc)
            if first is None:
                log.info("prefilling %s locally: no prefill peer succeeded", request_id)
                await self.engine.call(
                    lambda e: e.add_request(request_id, prompt_ids, params, cache_salt=cache_salt)
                )
            else:
                finished = first.finished
                yield first
            if not finished:
                async for out in self.engine.iterate(queue):
                    finished = out.finished
                    yield out
        finally:
            self.engine.close_stream(request_id)
            if not finished and self.engine.is_alive:
                await self.engine.call(lambda e: e.abort_request(request_id))


def share_prefill(
    first: AsyncGenerator[RequestOutput, None],
    later: Sequence[Callable[[], AsyncGenerator[RequestOutput, None]]],
) -> list[AsyncGenerator[RequestOutput, None]]:
    """Choices of one prompt: ``first`` runs at once, each of ``later`` starts when ``first``
    yielded its first output (its prompt is then computed and its full blocks are in the
    prefix cache, so the others compute only the last partial block) or ended."""
    ready = asyncio.Event()

    async def lead() -> AsyncGenerator[RequestOutput, None]:
        try:
            async with contextlib.aclosing(first):
                async for out in first:
                    ready.set()
                    yield out
        finally:
            ready.set()

    async def follow(
        start: Callable[[], AsyncGenerator[RequestOutput, None]],
    ) -> AsyncGenerator[RequestOutput, None]:
        await ready.wait()
        async with contextlib.aclosing(start()) as stream:
            async for out in stream:
                yield out

    return [lead(), *(follow(start) for start in later)]


async def merge_streams(
    streams: Sequence[AsyncGenerator[RequestOutput, None]],
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Interleave several requests' outputs as ``(index, output)`` in arrival order.

    A request that fails fails the whole merge; closing the merge closes (and so aborts) every
    request still running. Each stream is pumped by its own task so one slow request never
    holds back another's tokens.
    """
    if len(streams) == 1:
        # The common case needs no tasks: iterate directly, closing on the way out.
        async with contextlib.aclosing(streams[0]) as only:
            async for out in only:
                yield 0, out
        return

    queue: asyncio.Queue[tuple[int, RequestOutput] | Exception | None] = asyncio.Queue()

    async def pump(index: int, stream: AsyncGenerator[RequestOutput, None]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for out in stream:
                    queue.put_nowait((index, out))
        except Exception as exc:  # handed to the consumer, who re-raises it
            queue.put_nowait(exc)
        else:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        # Wait for every pump so each request's abort has reached the engine before we return.
        await asyncio.gather(*tasks, return_exceptions=True)
