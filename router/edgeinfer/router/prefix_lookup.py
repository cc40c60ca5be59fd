"""From a request body to prefix hits per daemon: tokenise as the daemon will, look the keys up.

Tokenizers are fetched once per ``tokenizer_id`` (``GET /v1/tokenizer`` on a daemon advertising
it, with the router's daemon key: the route is keyed like ``/v1/kv_snapshot``) in the
background; until one is here, requests are placed without prefix knowledge (session affinity
stands in, :mod:`edgeinfer.router.session_affinity`). Prompts longer than ``inline_chars`` are
rendered and encoded on a small thread pool (``tokenizers`` releases the GIL), shorter ones
inline: a pool hop costs more than encoding a few hundred tokens.

Only daemons that tokenise alike (same ``tokenizer_id`` and block size) are asked: their keys
are the only ones the request's keys can match. Which daemons those are is worked out once per
registry snapshot and model, not per request: the scan costs ~0.2 ms at 700 daemons, more than
the placement it serves. And they are asked only once the selector has pruned its candidates
(:class:`~edgeinfer.router.placement.PrefixHits` carries the lookup, not its answer): the index
costs ~2 us per daemon asked, ~2 ms for a fleet of 700.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp
import orjson

from edgeinfer.router.daemon_key import DaemonKey
from edgeinfer.router.errors import RouterError
from edgeinfer.router.metrics import RouterMetrics
from edgeinfer.router.placement import PrefixHits
from edgeinfer.router.pop_registry import DaemonView, Snapshot
from edgeinfer.router.prefix_index import PrefixIndex, key_array
from edgeinfer.router.router_tokenizer import PromptText, RouterTokenizer

log = logging.getLogger(__name__)

INLINE_CHARS = 2048  # ~500 tokens, ~0.5 ms to encode: below, cheaper than a worker thread hop
RETRY_S = 10.0  # after a failed fetch, before the next daemon is asked
FETCH_TIMEOUT_S = 10.0

_Group = tuple[str, int, set[str]]  # tokenizer_id, block size, the URLs of its daemons


class PrefixLookup:
    def __init__(
        self,
        index: PrefixIndex,
        session: aiohttp.ClientSession | None,
        daemon_key: DaemonKey | None,
        metrics: RouterMetrics | None,
        *,
        workers: int = 2,
        inline_chars: int = INLINE_CHARS,
    ) -> None:
        self._index = index
        self._session = session
        self._daemon_key = daemon_key
        self._metrics = metrics
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokenize")
        self._inline_chars = inline_chars
        self._tokenizers: dict[str, RouterTokenizer] = {}
        self._fetching: dict[str, asyncio.Task[None]] = {}
        self._failed_at: dict[str, float] = {}
        # The last snapshot's tokenizer groups, per model (see _group).
        self._groups: tuple[Snapshot | None, dict[str | None, _Group | None]] = (None, {})

    def add(self, tokenizer: RouterTokenizer) -> None:
        """A tokenizer known without fetching (tests, benchmarks)."""
        self._tokenizers[tokenizer.tokenizer_id] = tokenizer

    async def close(self) -> None:
        for task in self._fetching.values():
            task.cancel()
        for task in list(self._fetching.values()):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def lookup(
        self, path: str, data: Any, header_salt: str | None, views: Sequence[DaemonView],
        model: str | None,
    ) -> PrefixHits | None:  # fmt: skip
        """Hits per daemon for this request, or None without prefix knowledge (no tokenizer
        fetched yet, a body the router cannot read as the daemon will, no daemon of the model)."""
        group = self._group(views, model)
        if group is None:
            return None
        tok_id, block_size, urls = group
        tok = self._tokenizers.get(tok_id)
        if tok is None or tok.block_size != block_size:
            self._fetch_soon(tok_id, [v for v in views if v.url in urls])
            return None
        prompt = tok.prompt_text(path, data)
        if prompt is None:
            return None
        started = time.perf_counter()
        if prompt.text is not None and len(prompt.text) > self._inline_chars:
            loop = asyncio.get_running_loop()
            n, cached, keys = await loop.run_in_executor(
                self._pool, _keys, tok, prompt, header_salt, True
            )
        else:
            n, cached, keys = _keys(tok, prompt, header_salt)
        if self._metrics is not None:
            self._metrics.tokenize_seconds.observe(time.perf_counter() - started)
            self._metrics.tokenize_tokens.inc(n)
            self._metrics.tokenize_tokens_cached.inc(cached)
            self._metrics.prefix_blocks_asked.inc(len(keys))  # matched: by the proxy, as placed
        if not keys:
            return PrefixHits(n, 0, block_size, {})
        q, index = key_array(keys), self._index

        def lookup(candidates: Collection[str]) -> dict[str, int]:
            # The selector's candidates only (module doc), of those that tokenise alike.
            return index.lookup(q, [u for u in candidates if u in urls])

        return PrefixHits(n, len(keys), block_size, {}, lookup)

    def _group(self, views: Sequence[DaemonView], model: str | None) -> _Group | None:
        """:func:`_tokenizer_group`, kept for the registry's current snapshot: a snapshot is a
        new list whenever a view changes, so the same object has the same answer. (A plain
        list may be changed in place: it is scanned every time.)"""
        if not isinstance(views, Snapshot):
            return _tokenizer_group(views, model)
        seen, groups = self._groups
        if seen is not views:
            groups = {}
            self._groups = (views, groups)
        if model not in groups:
            groups[model] = _tokenizer_group(views, model)
        return groups[model]

    def _fetch_soon(self, tok_id: str, holders: list[DaemonView]) -> None:
        if self._session is None or tok_id in self._fetching:
            return
        failed = self._failed_at.get(tok_id)
        if failed is not None and time.monotonic() - failed < RETRY_S:
            return
        task = asyncio.create_task(self._fetch(tok_id, holders), name=f"tokenizer-{tok_id}")
        self._fetching[tok_id] = task
        task.add_done_callback(lambda _: self._fetching.pop(tok_id, None))

    async def _fetch(self, tok_id: str, holders: list[DaemonView]) -> None:
        session = self._session
        if session is None:
            return
        headers = self._daemon_key.headers() if self._daemon_key is not None else None
        timeout = aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S)
        for view in sorted(holders, key=lambda v: (not v.available, v.url)):
            try:
                async with session.get(
                    view.url + "/v1/tokenizer", headers=headers, timeout=timeout
                ) as resp:
                    if resp.status != 200:
                        raise RouterError(f"answered {resp.status}")
                    body = orjson.loads(await resp.read())
                loop = asyncio.get_running_loop()
                tok = await loop.run_in_executor(self._pool, RouterTokenizer, body)
            except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, RouterError) as e:
                log.warning("cannot fetch tokenizer %s from %s: %s", tok_id, view.url, e)
                continue
            if tok.tokenizer_id != tok_id:
                log.warning("%s serves tokenizer %s, not %s", view.url, tok.tokenizer_id, tok_id)
                continue
            self._tokenizers[tok_id] = tok
            self._failed_at.pop(tok_id, None)
            log.info("tokenizer %s fetched from %s", tok_id, view.url)
            return
        self._failed_at[tok_id] = time.monotonic()


def _keys(
    tok: RouterTokenizer, prompt: PromptText, header_salt: str | None, release_gil: bool = False
) -> tuple[int, int, list[bytes]]:
    salt = tok.salt(header_salt, prompt)
    ids, cached = tok.encode_counted(prompt, release_gil, salt)
    return len(ids), cached, tok.block_keys(ids, salt)


def _tokenizer_group(views: Sequence[DaemonView], model: str | None) -> _Group | None:
    """The (tokenizer_id, block_size) most of the model's daemons share, and their URLs
    (without a model: the most widely served one, as the selector defaults)."""
    if model is None:
        models = Counter(v.model for v in views if v.available and v.model and v.role != "prefill")
        if not models:
            return None
        model = min(models, key=lambda m: (-models[m], m))
    groups: Counter[tuple[str, int]] = Counter()
    for v in views:
        if v.tokenizer_id and v.available and v.model == model:
            groups[(v.tokenizer_id, v.block_size)] += 1
    if not groups:
        return None
    (tok_id, block_size), _ = min(groups.items(), key=lambda kv: (-kv[1], kv[0]))
    urls = {
        v.url for v in views
        if v.tokenizer_id == tok_id and v.block_size == block_size
        and v.model == model
    }  # fmt: skip
    return tok_id, block_size, urls
