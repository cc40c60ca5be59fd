"""CORS for the OpenAI routes, so a browser app on an allowed origin can call the router.

Off unless ``cors_allowed_origins`` names origins (``"*"`` allows any). Preflights are answered
by ``aiohttp-cors``; requests may carry any header (the ``openai`` SDK sends its own
``x-stainless-*`` ones; ``x-edge-*`` are stripped before a daemon sees them anyway). Browsers get
to read the request id, placement and rate-limit headers. Credentials (cookies) are never
allowed: the API authenticates with ``Authorization``, which needs none, and a cookie-carrying
cross-origin call is exactly what an API key should not ride on.
"""

from __future__ import annotations

from collections.abc import Iterable

import aiohttp_cors
from aiohttp import web

from edgeinfer.router.relay import DECODE_POP_HEADER, PREFILL_POP_HEADER
from edgeinfer.shared.request_ids import REQUEST_ID_HEADER

EXPOSED_HEADERS = (
    REQUEST_ID_HEADER,
    "Retry-After",
    *(f"x-ratelimit-{what}-{kind}" for kind in ("requests", "tokens")
      for what in ("limit", "remaining", "reset")),
    PREFILL_POP_HEADER,
    DECODE_POP_HEADER,
)  # fmt: skip
MAX_AGE_S = 600  # how long a browser may cache a preflight answer


def enable_cors(
    app: web.Application, origins: Iterable[str], routes: Iterable[web.AbstractRoute]
) -> None:
    """Allow ``origins`` on ``routes``; does nothing when ``origins`` is empty."""
    origins = tuple(origins)
    if not origins:
        return
    options = aiohttp_cors.ResourceOptions(
        allow_credentials=False,
        expose_headers=EXPOSED_HEADERS,
        allow_headers="*",
        max_age=MAX_AGE_S,
    )
    cors = aiohttp_cors.setup(app, defaults={origin: options for origin in origins})
    for route in routes:
        cors.add(route)
