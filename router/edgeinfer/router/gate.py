"""Admission of one public request: its API key, the models it may use, and its tenant's limits.

The proxy calls :meth:`Gate.admit` before placing a request; a refusal is a
:class:`GateRejection` carrying the OpenAI error to answer (401 ``invalid_api_key``, 403
``model_not_allowed``, 429 ``rate_limit_exceeded`` or ``concurrency_limit_exceeded``, with
``Retry-After`` and the ``x-ratelimit-*`` headers). An :class:`Admission` then follows the
answer: the proxy hands it every piece of body it forwards, so completion tokens count against
the tenant's window as they stream, and calls :meth:`Admission.finish` when the request ends.

Requests and tokens are counted in :class:`RateLimits` (this router's memory, or Redis shared by
a region's routers); streams in flight (``max_concurrent``) are counted in this process only.
Without ``api_keys_file`` every request is admitted as tenant None.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections import Counter
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from edgeinfer.router.config import RouterConfig
from edgeinfer.router.errors import RouterError
from edgeinfer.router.rate_limits import Kind, RateLimits, Window, storage_uri
from edgeinfer.router.tenants import KeyTable, TenantKey, load_keys
from edgeinfer.shared.errors import ConfigError

_USAGE_OBJECT = re.compile(rb'"usage"\s*:\s*\{')
log = logging.getLogger(__name__)

TENANT_HEADER = "x-edge-tenant"
CACHE_SALT_HEADER = "x-edge-cache-salt"
# Completion tokens are hit in batches this size while an answer streams, not one by one.
FLUSH_TOKENS = 32
# A non-streaming body is parsed for its usage up to this size, else estimated from its length.
MAX_USAGE_BODY = 8 << 20
_SSE_LINE_MAX = 1 << 20
_NO_KEY = (
    "You didn't provide an API key. You need to provide your API key in an Authorization "
    "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)
_LIMIT_NAMES = {"requests": "requests per minute (RPM)", "tokens": "tokens per minute (TPM)"}


class GateRejection(RouterError):
    """A refused request: answer it with ``status``, ``body`` (an OpenAI error) and ``headers``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str,  # shadows the builtin: OpenAI names the field so
        code: str,
        param: str | None = None,
        tenant: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.tenant = tenant
        self.body: dict[str, Any] = {
            "error": {"message": message, "type": type, "param": param, "code": code}
        }
        self.headers: dict[str, str] = headers or {}


def check_gate_config(config: RouterConfig) -> None:
    """Start-up validation, so a bad keys file or storage URI is a configuration error."""
    storage_uri(config.rate_limit_storage)
    if config.api_keys_file is not None:
        load_keys(config.api_keys_file)


class Gate:
    """The router's admission control; one per process, built by :meth:`create`."""

    def __init__(self, config: RouterConfig, table: KeyTable | None, limits: RateLimits | None):
        self.config = config
        self._table = table
        self._limits = limits
        self._in_flight: Counter[str] = Counter()  # streams per tenant, in this process
        self._tasks: set[asyncio.Task[None]] = set()

    @classmethod
    async def create(cls, config: RouterConfig) -> Gate:
        if config.api_keys_file is None:
            log.warning(
                "no api_keys_file: the OpenAI API is open to anyone who reaches this router "
                "(fine for local use only)"
            )
            return cls(config, None, None)
        table = KeyTable(load_keys(config.api_keys_file))
        limits = await RateLimits.create(config.rate_limit_storage)
        _log_keys(table, config.api_keys_file, limits)
        return cls(config, table, limits)

    @property
    def storage_errors(self) -> int:
        """Calls the shared rate-limit store failed (each was served from memory instead)."""
        return self._limits.storage_errors if self._limits else 0

    @property
    def degraded(self) -> bool:
        """True while the shared rate-limit store is down (limits are per router meanwhile)."""
        return self._limits is not None and self._limits.degraded

    def reload(self) -> None:
        """SIGHUP: adopt the keys file as it is now; a bad file keeps the current keys."""
        path = self.config.api_keys_file
        if path is None or self._limits is None:
            return
        try:
            table = KeyTable(load_keys(path))
        except ConfigError as exc:
            log.error("SIGHUP: keeping the current API keys: %s", exc)
            return
        self._table = table  # a removed key is refused from the next request on
        _log_keys(table, path, self._limits)

    async def admit(
        self, request: web.Request, model: str | None, prompt_tokens_estimate: int
    ) -> Admission:
        """Admit ``request`` or raise :class:`GateRejection`.

        ``model`` is the body's model, None when the request names none: a GET (``/v1/models``)
        needs no model, but a key restricted to some models must name one in a POST.
        """
        table, limits = self._table, self._limits
        if table is None or limits is None:
            return Admission(self, None, 0, {})
        key = _authenticate(table, request.headers.get("Authorization"))
        tenant = key.tenant
        try:
            if model is not None or request.method != "GET":
                _check_model(key, model)
            if key.max_concurrent is not None and self._in_flight[tenant] >= key.max_concurrent:
                raise GateRejection(
                    429,
                    f"Too many concurrent requests for tenant '{tenant}': at most "
                    f"{key.max_concurrent} in flight. Retry when one of them has finished.",
                    type="requests", code="concurrency_limit_exceeded", tenant=tenant,
                    headers={"Retry-After": "1"},
                )  # fmt: skip
        except GateRejection as rejection:
            # The tenant's windows as they stand (nothing taken): its answers all carry them.
            for kind, limit in _limits_of(key):
                window = await limits.window(kind, tenant, limit)
                rejection.headers.update(_window_headers(kind, window))
            raise
        self._in_flight[tenant] += 1
        try:
            headers: dict[str, str] = {}
            cost = max(0, prompt_tokens_estimate)
            if key.requests_per_minute is not None:
                await _take(limits, key, "requests", key.requests_per_minute, 1, headers)
            if key.tokens_per_minute is not None:
                await _take(limits, key, "tokens", key.tokens_per_minute, cost, headers)
        except BaseException:
            self._release(tenant)
            raise
        return Admission(self, key, cost, headers)

    def _release(self, tenant: str) -> None:
        self._in_flight[tenant] -= 1
        if self._in_flight[tenant] <= 0:
            del self._in_flight[tenant]

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(coro, name="gate-token-flush")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._limits is not None:
            await self._limits.close()


async def _take(
    limits: RateLimits, key: TenantKey, kind: Kind, limit: int, cost: int, headers: dict[str, str]
) -> None:
    """Hit one window; add its x-ratelimit-* headers, and refuse when it has no room."""
    taken = cost == 0 or await limits.hit(kind, key.tenant, limit, cost)
    window = await limits.window(kind, key.tenant, limit)
    headers.update(_window_headers(kind, window))
    if taken:
        return
    wait = window.seconds_until_room(cost)
    retry = max(1, math.ceil(min(wait, window.reset_s())))
    headers["Retry-After"] = str(retry)
    if wait == math.inf:
        message = (
            f"Request too large for tenant '{key.tenant}': about {cost} prompt tokens, more "
            f"than its limit of {limit} {_LIMIT_NAMES[kind]}. Send a shorter prompt."
        )
    else:
        message = (
            f"Rate limit reached for {_LIMIT_NAMES[kind]} of tenant '{key.tenant}': limit "
            f"{limit}, used {window.used}, requested {cost}. Please try again in {retry}s."
        )
    raise GateRejection(
        429, message, type=kind, code="rate_limit_exceeded", tenant=key.tenant, headers=headers
    )


class Admission:
    """One admitted request: its tenant, the headers it adds, and its token accounting."""

    def __init__(
        self, gate: Gate, key: TenantKey | None, prompt_tokens: int, headers: dict[str, str]
    ) -> None:
        self._gate = gate
        self._key = key
        self.tenant = key.tenant if key is not None else None
        self._headers = headers
        # Tokens are counted only for a key with a token limit, in the gate's windows.
        self._tpm = key.tokens_per_minute if key is not None else None
        self._limits = gate._limits if self._tpm is not None else None
        self._prompt = prompt_tokens
        self._counted = 0  # completion tokens already hit in the window
        self._observed = 0  # completion tokens seen in the answer
        self._usage_total: int | None = None  # the answer's own usage, when it carries one
        self._sse_tail = b""
        self._body = bytearray()
        self._body_bytes = 0
        self._flush: asyncio.Task[None] | None = None
        self._finished = False

    def upstream_headers(self) -> dict[str, str]:
        """What the router tells the daemon: the tenant, and the prefix-cache salt."""
        if self.tenant is None:
            return {}
        headers = {TENANT_HEADER: self.tenant}
        if not self._gate.config.share_prefix_cache_across_tenants:
            headers[CACHE_SALT_HEADER] = self.tenant
        return headers

    def response_headers(self) -> dict[str, str]:
        """``x-ratelimit-*`` for the client, for the limits its key has (as of admission)."""
        return dict(self._headers)

    def observe(self, data: bytes, sse: bool) -> None:
        """Count the completion tokens in ``data``, a piece of the answer the client is sent."""
        if self._limits is None or self._finished or not data:
            return
        if sse:
            self._observe_sse(data)
        else:
            self._body_bytes += len(data)
            if self._body_bytes <= MAX_USAGE_BODY:
                self._body += data
        if self._observed - self._counted >= FLUSH_TOKENS and (
            self._flush is None or self._flush.done()
        ):
            self._flush = self._gate._spawn(self._hit_observed(self._limits))

    def _observe_sse(self, data: bytes) -> None:
        lines = (self._sse_tail + data).split(b"\n")
        self._sse_tail = lines.pop()
        if len(self._sse_tail) > _SSE_LINE_MAX:
            self._sse_tail = b""  # no real event is this long: do not hold on to it
        for line in lines:
            if line.startswith(b"data:"):
                self._event(line[5:].strip())

    def _event(self, payload: bytes) -> None:
        if not payload or payload == b"[DONE]":
            return
        # Decoding every event cost more than the rest of the relay (~9 us each); only the rare
        # events carrying a usage object or token ids need it. Any other event is counted as
        # one streamed delta: the role and finish events make that a slight overcount, which
        # errs on the tenant's side of its window, never the endpoint's.
        if b'"token_ids"' not in payload and _USAGE_OBJECT.search(payload) is None:
            self._observed += 1
            return
        try:
            event = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return
        if not isinstance(event, dict):
            return
        self._take_usage(event.get("usage"))
        choices = event.get("choices")
        if isinstance(choices, list):
            self._observed += sum(_choice_tokens(c) for c in choices if isinstance(c, dict))

    def _take_usage(self, usage: Any) -> None:
        if isinstance(usage, dict):
            prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if isinstance(prompt, int) and isinstance(completion, int):
                self._usage_total = prompt + completion

    async def _hit_observed(self, limits: RateLimits) -> None:
        count = self._observed - self._counted
        self._counted += count
        await limits.consume("tokens", self.tenant or "", self._tpm or 0, count)

    async def finish(self) -> None:
        """The request is over: free its concurrency slot and settle its tokens. Idempotent."""
        if self._finished:
            return
        self._finished = True
        if self._key is None:
            return
        self._gate._release(self._key.tenant)
        limits = self._limits
        if limits is None or self._tpm is None:
            return
        if self._flush is not None:
            await self._flush
        if self._body_bytes:
            self._settle_body()
        if self._sse_tail:
            self._observe_sse(b"\n")
        # The prompt estimate was hit at admission; nothing can be given back, so only a
        # larger real count adds the difference.
        total = self._usage_total
        counted = self._prompt + self._counted
        extra = (total if total is not None else self._prompt + self._observed) - counted
        if extra > 0:
            self._counted += extra
            await limits.consume("tokens", self._key.tenant, self._tpm, extra)

    def _settle_body(self) -> None:
        """A whole JSON answer: its usage, or ~4 bytes a token when it is too big to parse."""
        if self._body_bytes > MAX_USAGE_BODY:
            self._observed += self._body_bytes // 4
            return
        try:
            body = orjson.loads(self._body)
        except orjson.JSONDecodeError:
            return  # not an answer (an error page): nothing was generated
        if isinstance(body, dict):
            self._take_usage(body.get("usage"))


GATE_KEY = web.AppKey("gate", Gate)


def _authenticate(table: KeyTable, header: str | None) -> TenantKey:
    if header is None or not header.strip():
        raise GateRejection(401, _NO_KEY, type="invalid_request_error", code="invalid_api_key",
                            headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
    scheme, _, presented = header.strip().partition(" ")
    presented = presented.strip()
    if scheme.lower() != "bearer" or not presented:
        raise GateRejection(
            401, "The Authorization header must be 'Bearer YOUR_KEY'.",
            type="invalid_request_error", code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )  # fmt: skip
    key = table.lookup(presented)
    if key is None:
        # Never echo the key: this answer may end up in logs the key's owner does not control.
        raise GateRejection(
            401, "Incorrect API key provided.", type="invalid_request_error",
            code="invalid_api_key", headers={"WWW-Authenticate": 'Bearer error="invalid_token"'},
        )  # fmt: skip
    return key


def _check_model(key: TenantKey, model: str | None) -> None:
    if not key.models or (model is not None and key.allows(model)):
        return
    allowed = ", ".join(repr(m) for m in key.models)
    what = "names no model" if model is None else f"asks for the model {model!r}"
    raise GateRejection(
        403, f"This request {what}; this API key may use only {allowed}.",
        type="invalid_request_error", code="model_not_allowed", param="model", tenant=key.tenant,
    )  # fmt: skip


def _choice_tokens(choice: dict[str, Any]) -> int:
    """Tokens one SSE choice carried: its token ids when sent, else one per non-empty delta."""
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        return len(ids)
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return 1 if delta.get("content") or delta.get("tool_calls") else 0
    return 1 if choice.get("text") else 0


def _limits_of(key: TenantKey) -> list[tuple[Kind, int]]:
    kinds: list[tuple[Kind, int | None]] = [
        ("requests", key.requests_per_minute),
        ("tokens", key.tokens_per_minute),
    ]
    return [(kind, limit) for kind, limit in kinds if limit is not None]


def _window_headers(kind: Kind, window: Window) -> dict[str, str]:
    return {
        f"x-ratelimit-limit-{kind}": str(window.limit),
        f"x-ratelimit-remaining-{kind}": str(window.remaining),
        f"x-ratelimit-reset-{kind}": duration(window.reset_s()),
    }


def duration(seconds: float) -> str:
    """OpenAI's reset format: ``120ms``, ``17.5s``, ``6m0s``."""
    ms = math.ceil(max(0.0, seconds) * 1000)
    if ms < 1000:
        return f"{ms}ms"
    minutes, ms = divmod(ms, 60_000)
    secs = f"{ms / 1000:.3f}".rstrip("0").rstrip(".")
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def _log_keys(table: KeyTable, path: Path, limits: RateLimits) -> None:
    if not table.keys:
        log.warning("api_keys_file %s holds no keys: every request is refused", path)
    else:
        log.info(
            "%d API keys of %d tenants from %s; rate limits in %s",
            len(table.keys), len(table.tenants()), path, limits.description,
        )  # fmt: skip
