"""Where the HTTP layer gets a request's outputs: the seam between the API and the engine(s).

:class:`RequestRunner` is the only object the handlers ask for tokens. Today it prefills every
prompt locally; disaggregated serving (KV computed by a prefill daemon and shipped over
ZeroMQ) plugs in inside :meth:`RequestRunner.run` without the handlers changing, because they
only ever see an async iterator of :class:`RequestOutput`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Sequence

from edgeinfer.daemon.config import DaemonConfig
from edgeinfer.daemon.engine.async_engine import AsyncEngine
from edgeinfer.daemon.engine.outputs import RequestOutput
from edgeinfer.daemon.engine.sampling_params import SamplingParams
from edgeinfer.daemon.metrics import DaemonMetrics


class RequestRunner:
    def __init__(self, engine: AsyncEngine, config: DaemonConfig, metrics: DaemonMetrics) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics

    async def run(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        prefill_peer: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the outputs of one request until it finishes.

        ``prefill_peer`` is the ZeroMQ endpoint of a prefill daemon the request asked for (the
        ``x-edge-prefill`` header or ``kv_transfer_params.prefill_endpoint``), or None. The
        runner decides whether to use it (prompt length vs ``local_prefill_threshold``,
        ``prefill_peers``); remote prefill is not wired in yet, so every prompt is prefilled by
        the local engine.

        Closing the iterator before the last output aborts the request and frees its KV blocks
        at once; callers must close it (``contextlib.aclosing``) when they stop early.
        """
        timer = self.metrics.timer()
        stream = self.engine.generate(request_id, prompt_ids, params)
        async with contextlib.aclosing(stream):
            async for out in stream:
                timer.observe(out)
                yield out


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
