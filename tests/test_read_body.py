"""The daemon reads a request body into one buffer of its declared length, else as aiohttp does."""

from __future__ import annotations

import gzip
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from edgeinfer.daemon.api.request_body import MAX_BODY_BYTES, read_body

pytestmark = pytest.mark.asyncio

BODY = b'{"prompt": "' + b"the little town by the sea " * 40_000 + b'"}'  # ~1 MiB


async def echo(request: web.Request) -> web.Response:
    body = await read_body(request)
    return web.json_response({"length": len(body), "same": bytes(body) == BODY})


async def client_for(aiohttp_client: Any) -> Any:
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.router.add_post("/", echo)
    return await aiohttp_client(app)


async def test_a_body_with_a_length_is_read_whole(aiohttp_client: Any) -> None:
    client = await client_for(aiohttp_client)
    resp = await client.post("/", data=BODY)
    assert await resp.json() == {"length": len(BODY), "same": True}


async def test_a_chunked_or_compressed_body_is_read_whole(aiohttp_client: Any) -> None:
    client = await client_for(aiohttp_client)

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(BODY), 100_000):
            yield BODY[i : i + 100_000]

    resp = await client.post("/", data=chunks())  # no Content-Length: chunked
    assert await resp.json() == {"length": len(BODY), "same": True}
    headers = {"Content-Encoding": "gzip"}
    resp = await client.post("/", data=gzip.compress(BODY), headers=headers)
    assert await resp.json() == {"length": len(BODY), "same": True}


async def test_a_body_over_the_limit_is_413(aiohttp_client: Any) -> None:
    client = await client_for(aiohttp_client)
    resp = await client.post("/", data=b" " * (MAX_BODY_BYTES + 1))
    assert resp.status == 413
