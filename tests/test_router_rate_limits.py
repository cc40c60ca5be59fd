"""Tenant windows in memory: storage names, the sliding-window arithmetic, and a store outage."""

from __future__ import annotations

import math

import pytest

from edgeinfer.router.rate_limits import WINDOW_S, RateLimits, Window, storage_uri
from edgeinfer.shared.errors import ConfigError
from edgeinfer.shared.processes import free_port


@pytest.mark.parametrize(
    ("raw", "uri"),
    [
        ("memory://", "async+memory://"),
        ("redis://10.0.0.5:6379", "async+redis://10.0.0.5:6379"),
        ("redis://:pw@10.0.0.5:6379/2", "async+redis://:pw@10.0.0.5:6379/2"),
        ("rediss://cache:6380", "async+rediss://cache:6380"),
        ("valkey://cache:6379", "async+valkey://cache:6379"),
        ("async+redis://cache:6379", "async+redis://cache:6379"),
        ("REDIS://cache:6379", "async+redis://cache:6379"),
    ],
)
def test_the_operators_uri_becomes_the_async_storage(raw: str, uri: str) -> None:
    assert storage_uri(raw) == uri


@pytest.mark.parametrize("raw", ["memcached://:pw@x:11211", "redis", "", "http://x"])
def test_other_storages_are_refused(raw: str) -> None:
    with pytest.raises(ConfigError, match="config key 'rate_limit_storage' must be memory://") as e:
        storage_uri(raw)
    assert "pw" not in str(e.value)  # credentials stay out of logs


def test_a_window_weighs_the_previous_minute_by_what_it_still_covers() -> None:
    # 40 s left of the current minute: the previous one counts for 40/60 of its hits.
    w = Window(limit=100, previous=60, previous_ttl=40.0, current=30, current_ttl=WINDOW_S + 40.0)
    assert (w.used, w.remaining) == (70, 30)
    assert w.seconds_until_room(30) == 0.0
    # 45 needs the previous minute's weight down to 25: 60 * t / 60 = 25 -> 25 s left -> in 15 s.
    assert w.seconds_until_room(45) == pytest.approx(15.0)
    # 80 does not fit before this minute ends (40 s); then its 30 hits decay: 30*(1-x) <= 20.
    assert w.seconds_until_room(80) == pytest.approx(40.0 + WINDOW_S / 3)
    assert w.reset_s() == pytest.approx(40.0 + WINDOW_S)
    assert w.seconds_until_room(101) == math.inf


def test_an_empty_window_is_all_room() -> None:
    w = Window(limit=5)
    assert (w.used, w.remaining, w.seconds_until_room(5), w.reset_s()) == (0, 5, 0.0, 0.0)


@pytest.mark.asyncio
async def test_hits_stop_at_the_limit_and_consume_fills_what_is_left() -> None:
    limits = await RateLimits.create("memory://")
    try:
        assert not limits.shared
        assert [await limits.hit("requests", "acme", 2) for _ in range(3)] == [True, True, False]
        assert (await limits.window("requests", "acme", 2)).remaining == 0
        assert await limits.hit("requests", "beta", 2)  # per tenant
        assert await limits.hit("tokens", "acme", 100, 70)
        assert not await limits.hit("tokens", "acme", 100, 40)  # refused: nothing taken
        assert (await limits.window("tokens", "acme", 100)).used == 70
        # Tokens already served cannot be refused: they fill the window to its limit.
        await limits.consume("tokens", "acme", 100, 40)
        assert (await limits.window("tokens", "acme", 100)).used == 100
    finally:
        await limits.close()


@pytest.mark.asyncio
async def test_a_store_that_does_not_answer_leaves_limits_to_this_router(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = free_port()  # nothing listens there
    limits = await RateLimits.create(f"redis://:hunter2@127.0.0.1:{port}")
    try:
        assert limits.shared and limits.degraded
        assert limits.storage_errors == 1
        assert f"rate-limit store redis://127.0.0.1:{port} failed" in caplog.text
        assert "enforced by this router alone" in caplog.text
        assert "hunter2" not in caplog.text
        # Still limited, in memory, without waiting for the store on every call.
        assert [await limits.hit("requests", "acme", 2) for _ in range(3)] == [True, True, False]
        assert limits.storage_errors == 1
        assert len(caplog.records) == 1
    finally:
        await limits.close()
