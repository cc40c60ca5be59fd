"""Request ids: what a client may send, what is generated, and the log filter that stamps them."""

from __future__ import annotations

import asyncio
import io
import logging
import re

import pytest

from edgeinfer.shared.logs import configure_logging, make_formatter
from edgeinfer.shared.request_ids import (
    RequestIdFilter,
    bind_request_id,
    current_request_id,
    new_request_id,
    request_id_from,
    unbind_request_id,
    valid_request_id,
)


@pytest.mark.parametrize("value", ["a", "req-1", "A.b_c:d-9", "x" * 128])
def test_valid_ids_are_kept(value: str) -> None:
    assert valid_request_id(value) and request_id_from(value) == value


@pytest.mark.parametrize(
    "value", [None, "", "x" * 129, "has space", 'q"uote', "a=b", "new\nline", "é", "a;b"]
)
def test_anything_else_is_replaced_by_a_fresh_id(value: str | None) -> None:
    assert not valid_request_id(value)
    replaced = request_id_from(value)
    assert re.fullmatch(r"[0-9a-f]{32}", replaced) and replaced != new_request_id()


def test_the_filter_stamps_the_bound_id_and_keeps_an_explicit_one() -> None:
    def record(**extra: object) -> logging.LogRecord:
        rec = logging.LogRecord("edgeinfer.x", logging.INFO, __file__, 1, "m", None, None)
        rec.__dict__.update(extra)
        RequestIdFilter().filter(rec)
        return rec

    assert not hasattr(record(), "request_id")
    token = bind_request_id("r-1")
    try:
        assert record().request_id == "r-1"  # type: ignore[attr-defined]
        assert record(request_id="mine").request_id == "mine"  # type: ignore[attr-defined]
    finally:
        unbind_request_id(token)
    assert current_request_id() is None


@pytest.mark.asyncio
async def test_a_binding_stays_in_its_task() -> None:
    async def handle(request_id: str) -> str | None:
        bind_request_id(request_id)  # as the router's middleware does: never unbound
        await asyncio.sleep(0)
        return current_request_id()

    assert await asyncio.gather(
        asyncio.create_task(handle("a")), asyncio.create_task(handle("b"))
    ) == ["a", "b"]
    assert current_request_id() is None


def test_configure_logging_stamps_every_line_and_text_shows_the_id(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    monkeypatch.setattr(root, "level", root.level)
    out = io.StringIO()
    assert configure_logging("info", "kv", out)
    assert configure_logging("info", "text", out)  # a reload installs the filter only once
    assert len(root.handlers[0].filters) == 1
    token = bind_request_id("r-42")
    try:
        logging.getLogger("edgeinfer.x").info("about the request")
    finally:
        unbind_request_id(token)
    logging.getLogger("edgeinfer.x").info("about nothing")
    first, second = out.getvalue().splitlines()
    assert first.endswith("about the request request_id=r-42")
    assert "request_id" not in second
    rec = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
    assert "request_id" not in make_formatter("text").format(rec)
