"""Large request bodies are decoded in a worker process: an over-long prompt is refused from the
body's shape without the daemon decoding it, and everything else is answered as before."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from edgeinfer.daemon.api import request_body
from edgeinfer.daemon.api.body_shape import Long
from edgeinfer.daemon.api.errors import APIError
from edgeinfer.daemon.api.request_body import LARGE_BODY_BYTES, MAX_BODY_BYTES, BodyDecoder
from edgeinfer.daemon.api.tokenize_pool import POOL_KEY

pytestmark = pytest.mark.asyncio

HUGE = "the little town by the sea " * 80_000  # ~2 MiB


@pytest.fixture
def daemon_decodes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Sizes of the bodies the daemon process itself decodes (the worker's are not counted)."""
    sizes: list[int] = []
    load_json = request_body.load_json

    def counting(raw: Any) -> dict[str, Any]:
        sizes.append(len(raw))
        return load_json(raw)

    monkeypatch.setattr(request_body, "load_json", counting)
    yield sizes


def _large(body: dict[str, Any]) -> bytes:
    data = orjson.dumps(body)
    assert len(data) > LARGE_BODY_BYTES
    return data


@pytest.mark.parametrize("kind", ["chat", "completion", "token-ids", "tokenize"])
async def test_an_over_long_prompt_is_refused_without_the_daemon_decoding_it(
    client: Any, daemon_decodes: list[int], kind: str
) -> None:
    paths = {"chat": "/v1/chat/completions", "tokenize": "/tokenize"}
    path = paths.get(kind, "/v1/completions")
    body: dict[str, Any] = {} if kind == "tokenize" else {"max_tokens": 4}
    if kind == "chat":
        body["messages"] = [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": HUGE},
        ]
    elif kind in ("completion", "tokenize"):
        body["prompt"] = HUGE
    else:
        body["prompt"] = [11] * 400_000
    resp = await client.post(path, data=_large(body), headers={"Content-Type": "application/json"})
    error = (await resp.json())["error"]
    assert resp.status == 400 and error["code"] == "context_length_exceeded", error
    assert daemon_decodes == []
    worker = client.app[POOL_KEY].bodies.worker_pid
    assert worker is not None
    if hasattr(os, "SCHED_IDLE"):  # below every normal task: it never holds a core they want
        assert os.sched_getscheduler(worker) == os.SCHED_IDLE


async def test_a_large_body_naming_another_model_is_404_from_its_shape(
    client: Any, daemon_decodes: list[int]
) -> None:
    body = {"model": "not-this-one", "prompt": HUGE, "max_tokens": 4}
    resp = await client.post("/v1/completions", data=_large(body))
    assert resp.status == 404 and (await resp.json())["error"]["code"] == "model_not_found"
    assert daemon_decodes == []


async def test_invalid_json_in_a_large_body_is_400_without_the_daemon_decoding_it(
    client: Any, daemon_decodes: list[int]
) -> None:
    data = _large({"prompt": HUGE})[:-1]  # the closing brace missing
    resp = await client.post("/v1/completions", data=data)
    error = (await resp.json())["error"]
    assert resp.status == 400 and "not valid JSON" in error["message"]
    assert daemon_decodes == []


async def test_a_large_body_that_may_fit_is_decoded_and_served(
    client: Any, daemon_decodes: list[int]
) -> None:
    # Long, but not a prompt: nothing proves the request too long, so the daemon decodes it.
    body = {"prompt": "Once upon a time", "max_tokens": 3, "user": "x" * (LARGE_BODY_BYTES + 10)}
    resp = await client.post("/v1/completions", data=_large(body))
    answer = await resp.json()
    assert resp.status == 200, answer
    assert answer["usage"]["completion_tokens"] == 3
    assert daemon_decodes == [len(_large(body))]
    # Large only by its whitespace: the shape is the whole body, decoded once, in the worker.
    daemon_decodes.clear()
    padded = orjson.dumps({"prompt": "Once upon a time", "max_tokens": 3})[:-1]
    padded += b" " * (LARGE_BODY_BYTES + 10) + b"}"
    resp = await client.post("/v1/completions", data=padded)
    assert resp.status == 200 and (await resp.json())["usage"]["completion_tokens"] == 3
    assert daemon_decodes == []


async def test_a_dead_worker_is_replaced_and_nothing_is_refused_meanwhile(
    client: Any, daemon_decodes: list[int]
) -> None:
    bodies = client.app[POOL_KEY].bodies
    data = _large({"prompt": HUGE, "max_tokens": 4})
    refusals = []
    resp = await client.post("/v1/completions", data=data)
    refusals.append((await resp.json())["error"]["code"])
    killed = bodies.worker_pid
    assert killed is not None
    os.kill(killed, signal.SIGKILL)
    # The next body may find the worker gone mid-exchange: the daemon then decodes it itself.
    for _ in range(2):
        resp = await client.post("/v1/completions", data=data)
        refusals.append((await resp.json())["error"]["code"])
    assert refusals == ["context_length_exceeded"] * 3
    assert bodies.worker_pid not in (None, killed)


async def _echo_app(aiohttp_client: Any, decoder: BodyDecoder) -> Any:
    refused: list[dict[str, Long]] = []

    def refuse(shape: dict[str, Any], long: Any) -> None:
        refused.append(dict(long))
        if shape.get("refuse"):
            raise APIError(400, "refused from the shape")

    async def handler(request: web.Request) -> web.Response:
        try:
            body = await request_body.decode_body(request, decoder, refuse)
        except APIError as exc:
            return web.json_response({"error": exc.message}, status=exc.status)
        return web.json_response({"keys": sorted(body), "refused": len(refused)})

    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.router.add_post("/", handler)
    return await aiohttp_client(app)


def _buffers() -> set[str]:
    shm = Path("/dev/shm")
    return {p.name for p in shm.glob("edgeinfer-body-*")} if shm.is_dir() else set()


async def test_the_worker_and_its_buffer_leave_nothing_behind(aiohttp_client: Any) -> None:
    before = _buffers()
    decoder = BodyDecoder(MAX_BODY_BYTES)
    client = await _echo_app(aiohttp_client, decoder)
    resp = await client.post("/", data=_large({"refuse": True, "text": HUGE}))
    assert resp.status == 400
    resp = await client.post("/", data=_large({"text": HUGE}))
    assert await resp.json() == {"keys": ["text"], "refused": 2}
    pid = decoder.worker_pid
    assert pid is not None
    # The buffer's name went as soon as the worker had mapped it.
    assert _buffers() == before
    await decoder.close()
    assert decoder.worker_pid is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
