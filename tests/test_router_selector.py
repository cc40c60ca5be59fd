"""Placement: nearest PoP at equal load, spill and return, exclusions, SLO, roles, near ties,
and the load this router placed since the heartbeats (spread, reset, drain). The load arrays
kept current between heartbeats: ``test_router_load_arrays.py``.

PoPs sit on cities of MaxMind's test database, so clients are located by real lookups.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from edgeinfer.router.geo import ClientLocator, GeoPoint
from edgeinfer.router.network import NetworkModel
from edgeinfer.router.pop_registry import DaemonView, PopConfig, PopRegistry
from edgeinfer.router.selector import (
    Placement,
    PlacementConfig,
    RequestFeatures,
    record_placement,
    select,
)
from edgeinfer.shared.heartbeat import Heartbeat

DB = Path(__file__).parent / "data" / "geoip" / "GeoIP2-City-Test.mmdb"
COORDS = {"lon": (51.5142, -0.0931), "sea": (47.2513, -122.3149), "cgq": (43.88, 125.3228)}
IPS = {"lon": "81.2.69.160", "sea": "216.160.83.56", "cgq": "175.16.199.0"}
LONDON = GeoPoint(*COORDS["lon"])
NET, CFG = NetworkModel(), PlacementConfig()


def hb(url: str, **overrides: Any) -> Heartbeat:
    pop = url.split("//")[1].split("-")[0]
    role = overrides.pop("role", "both")
    fields: dict[str, Any] = {
        "daemon_id": url,
        "pop": pop,
        "role": role,
        "model": "m",
        "kv_endpoint": None if role == "decode" else f"tcp://{pop}:5600",
        "running": 4,
        "waiting": 0,
        "kv_blocks_free": 4000,
        "kv_blocks_total": 4000,
        "block_size": 16,
        "prefill_tokens_per_s": 10_000.0,
        "decode_tokens_per_s": 500.0,
        "ttft_p50_s": None,
        "itl_p50_s": None,
        "queued_prefill_tokens": 0,
        "draining": False,
        "drained": False,
        "in_flight": 4,
        "kv_bytes_per_token": 131_072,
        "local_prefill_threshold": 512,
        "prefill_chunk_tokens": 2048,
        "tokenizer_id": "t",
        "prefix_caching": False,
        "kv_event_seq": 0,
        "seq": 1,
        "started_at": 1.0,
        "sent_at": 2.0,
    }
    return Heartbeat(**(fields | overrides))


class World:
    """A registry with one `both` daemon per PoP unless told otherwise; time advances per beat."""

    def __init__(self, daemons: dict[str, tuple[str, ...]] | None = None) -> None:
        daemons = daemons or {pop: (f"http://{pop}-1:8000",) for pop in COORDS}
        # No coalescing: each beat is in the next decision's snapshot.
        self.reg = PopRegistry(
            [PopConfig(p, *COORDS[p], daemons.get(p, ())) for p in COORDS], "lon", 5.0, 0.0
        )
        self.now, self.seq = 100.0, 1

    def beat(self, url: str, **overrides: Any) -> None:
        self.seq += 1
        assert self.reg.update(hb(url, seq=self.seq, **overrides), self.now) == "accepted"

    def place(self, client: GeoPoint = LONDON, prompt: int = 800, **kw: Any) -> list[Placement]:
        views = self.reg.snapshot(self.now)
        features = RequestFeatures(prompt, kw.pop("max_tokens", 128), kw.pop("model", "m"))
        rng = kw.pop("rng", random.Random(0))
        return select(views, client, features, NET, kw.pop("cfg", CFG), rng, "lon", **kw)


@pytest.fixture
def world() -> World:
    w = World()
    for pop in COORDS:
        w.beat(f"http://{pop}-1:8000")
    return w


def where(p: Placement) -> tuple[str, str]:
    return (p.prefill or p.decode).pop, p.decode.pop


def test_equal_load_places_each_continent_on_its_nearest_pop(world: World) -> None:
    locator = ClientLocator(DB, [], LONDON)
    for pop, ip in IPS.items():
        best = world.place(locator.locate(ip))[0]
        assert where(best) == (pop, pop) and best.prefill is None  # a `both` prefills itself


def test_long_queue_spills_to_the_next_pop_and_comes_back(world: World) -> None:
    world.beat("http://lon-1:8000", queued_prefill_tokens=2_000_000)  # 200 s of work
    spilled = world.place()[0]
    assert "lon" not in {(spilled.prefill or spilled.decode).pop}
    assert spilled.ttft_s < 1.0
    world.beat("http://lon-1:8000", queued_prefill_tokens=0)
    assert where(world.place()[0]) == ("lon", "lon")


def test_a_saturated_decode_daemon_loses_its_requests(world: World) -> None:
    world.beat("http://lon-1:8000", waiting=40, kv_blocks_free=1)
    best = world.place()[0]
    assert best.decode.pop != "lon" and best.breakdown["admission_s"] == 0.0
    world.beat("http://lon-1:8000", kv_blocks_free=0)
    assert all(p.decode.pop != "lon" for p in world.place(limit=3))


@pytest.mark.parametrize("how", ["draining", "stale", "admin"])
def test_unavailable_daemons_get_nothing_new(world: World, how: str) -> None:
    if how == "draining":
        world.beat("http://lon-1:8000", draining=True)
    elif how == "admin":
        world.reg.drain_pop("lon")
    else:
        world.now += 3 * 5.0 + 1  # every daemon silent; the others speak again
        world.beat("http://sea-1:8000")
        world.beat("http://cgq-1:8000")
    placements = world.place(limit=5)
    assert placements and all("lon" not in where(p) for p in placements)


def test_itl_slo_beats_distance_and_least_bad_when_nothing_meets_it(world: World) -> None:
    world.beat("http://lon-1:8000", running=100)  # 101 / 500 tok/s = 0.2 s per token
    best = world.place()[0]
    assert best.decode.pop != "lon" and best.meets_slo
    for pop in ("sea", "cgq"):
        world.beat(f"http://{pop}-1:8000", running=200)
    best = world.place()[0]
    assert best.decode.pop == "lon" and not best.meets_slo and best.itl_s == pytest.approx(0.202)


def test_roles_local_prefill_for_short_prompts_remote_for_long() -> None:
    w = World({"lon": ("http://lon-d:8000", "http://lon-p:8000"), "sea": ("http://sea-p:8000",)})
    w.beat("http://lon-d:8000", role="decode")
    w.beat("http://lon-p:8000", role="prefill")
    w.beat("http://sea-p:8000", role="prefill")
    short = w.place(prompt=100)[0]
    assert short.prefill is None and short.decode.url == "http://lon-d:8000"
    long = w.place(prompt=4000)[0]
    assert long.prefill is not None and long.prefill.url == "http://lon-p:8000"
    assert long.breakdown["kv_s"] == 0.0  # same PoP: no transfer
    w.beat("http://lon-p:8000", role="prefill", draining=True)
    far = w.place(prompt=4000)[0]
    assert far.prefill is not None and far.prefill.pop == "sea" and far.breakdown["kv_s"] > 0.07


def test_near_ties_use_two_random_choices() -> None:
    w = World({"lon": ("http://lon-a:8000", "http://lon-b:8000")})
    w.beat("http://lon-a:8000", running=2)
    w.beat("http://lon-b:8000", running=6)
    rng = random.Random(1)
    assert {w.place(rng=rng)[0].decode.url for _ in range(20)} == {"http://lon-a:8000"}
    w.beat("http://lon-b:8000", running=2)
    picks = Counter(w.place(rng=rng)[0].decode.url for _ in range(200))
    assert min(picks.values()) > 50  # equal load: both get a fair share, no herd


def test_placements_are_explained_and_distinct(world: World) -> None:
    placements = world.place(limit=3)
    assert len({p.decode.url for p in placements}) == 3
    assert [p.ttft_s for p in placements] == sorted(p.ttft_s for p in placements)
    for p in placements:
        terms = {k: v for k, v in p.breakdown.items() if k != "itl_s"}
        assert sum(terms.values()) == pytest.approx(p.ttft_s)
        assert p.decode.url in p.describe() and "ttft" in p.describe()
    assert len(world.place(limit=1)) == 1


def test_models_are_matched() -> None:
    w = World()
    w.beat("http://lon-1:8000", model="small")
    w.beat("http://sea-1:8000")
    w.beat("http://cgq-1:8000")
    assert w.place(model="nope") == []
    assert w.place(model="small")[0].decode.pop == "lon"
    assert w.place(model=None)[0].decode.model == "m"  # the most widely served


def test_nothing_available_means_no_placement() -> None:
    views: list[DaemonView] = []
    assert (
        select(views, LONDON, RequestFeatures(10, 10, None), NET, CFG, random.Random(), "x") == []
    )
    assert World().place() == []


def burst(w: World, n: int, now: float, prompt: int = 800) -> Counter[str]:
    """``n`` placements between two heartbeats, each recorded as the proxy does."""
    rng, picks = random.Random(2), Counter[str]()
    for _ in range(n):
        views = w.reg.snapshot(now)
        f = RequestFeatures(prompt, 128, "m")
        best = select(views, LONDON, f, NET, CFG, rng, "lon", pending=w.reg.pending, now=now)[0]
        record_placement(w.reg.pending, best, f, now)
        picks[best.decode.url] += 1
    return picks


def test_a_burst_between_heartbeats_spreads_over_daemons() -> None:
    """Without the ledger all 40 go to the less loaded daemon (see the near-tie test); with it
    the other one takes its share once the first has caught up."""
    w = World({"lon": ("http://lon-a:8000", "http://lon-b:8000")})
    w.beat("http://lon-a:8000", running=2)
    w.beat("http://lon-b:8000", running=6)
    picks = burst(w, 40, w.now)
    assert picks["http://lon-a:8000"] > picks["http://lon-b:8000"] >= 12
    # ...and the prefill queues they add are priced: each placement waits for the ones before.
    views = w.reg.snapshot(w.now)
    f = RequestFeatures(800, 128, "m")
    rng = random.Random(0)
    queued = select(views, LONDON, f, NET, CFG, rng, "lon", pending=w.reg.pending, now=w.now)
    assert queued[0].breakdown["prefill_queue_s"] > 10 * 800 / 10_000.0


def test_a_fresh_daemon_is_assumed_as_fast_as_its_measured_peers() -> None:
    """A daemon that has not served yet reports no rates; priced at the config's defaults
    (5,000 prefill tokens/s) beside peers measuring 700 it prefilled every long prompt of a
    burst. It is priced as the median of its model's measured daemons instead."""
    urls = ("http://lon-a:8000", "http://lon-b:8000", "http://lon-c:8000")
    w = World({"lon": urls})
    for url, rate in zip(urls, (700.0, 750.0, 0.0), strict=True):
        w.beat(url, running=0, in_flight=0, prefill_tokens_per_s=rate,
               decode_tokens_per_s=30.0 if rate else 0.0, itl_p50_s=0.02 if rate else None)  # fmt: skip
    prefilled, rng = Counter[str](), random.Random(0)
    for _ in range(3):
        f = RequestFeatures(1100, 128, "m")
        placed = select(w.reg.snapshot(w.now), LONDON, f, NET, CFG, rng, "lon",
                        pending=w.reg.pending, now=w.now)  # fmt: skip
        fresh = [p for p in placed if p.prefill is None and p.decode.url == urls[2]]
        if fresh:  # priced at the peers' median rate and ITL
            assert fresh[0].breakdown["prefill_compute_s"] == pytest.approx(1100 / 725.0)
            assert fresh[0].itl_s == pytest.approx(0.02)
        record_placement(w.reg.pending, placed[0], f, w.now)
        prefilled[(placed[0].prefill or placed[0].decode).url] += 1
    assert sorted(prefilled.values()) == [1, 1, 1]
    # With no daemon measured yet, the config's defaults stand in.
    w2 = World({"lon": urls[:1]})
    w2.beat(urls[0], running=0, prefill_tokens_per_s=0.0, decode_tokens_per_s=0.0)
    only = w2.place(prompt=1100, now=w2.now)[0]
    assert only.breakdown["prefill_compute_s"] == pytest.approx(
        1100 / CFG.default_prefill_tokens_per_s
    )


def test_a_heartbeat_that_includes_the_burst_replaces_it() -> None:
    w = World({"lon": ("http://lon-a:8000",)})
    w.beat("http://lon-a:8000", running=2)
    burst(w, 10, w.now)
    pending = w.reg.pending
    assert pending.totals("http://lon-a:8000")[0] == 10
    # Well past the network lag and the daemon's report lag (half of the 5 s period).
    w.now += 3.0
    w.beat("http://lon-a:8000", running=12, queued_prefill_tokens=0)
    views = w.reg.snapshot(w.now)  # the heartbeat is visible: what it includes stops counting
    assert tuple(pending.totals("http://lon-a:8000")) == (0.0, 0.0, 0.0)
    f = RequestFeatures(800, 128, "m")
    best = select(views, LONDON, f, NET, CFG, random.Random(0), "lon", pending=pending, now=w.now)
    # Priced from the heartbeat alone: 12 running (not 22), no queue (the burst was prefilled).
    assert best[0].itl_s == pytest.approx(13 / 500.0)
    assert best[0].breakdown["prefill_queue_s"] == 0.0


def test_pending_prefill_drains_with_time() -> None:
    """Pending prompt tokens are worked off as the seconds pass: 10 x 800 tokens at 10k tokens/s
    are 0.8 s of work, gone 1 s later even though no heartbeat has come."""
    w = World({"lon": ("http://lon-a:8000",)})
    w.beat("http://lon-a:8000")
    burst(w, 10, w.now)
    f = RequestFeatures(800, 128, "m")
    at = {}
    for dt in (0.0, 0.4, 1.0):
        views = w.reg.snapshot(w.now + dt)
        p = select(views, LONDON, f, NET, CFG, random.Random(0), "lon",
                   pending=w.reg.pending, now=w.now + dt)[0]  # fmt: skip
        at[dt] = p.breakdown["prefill_queue_s"]
    assert at[0.0] == pytest.approx(0.8) and at[0.4] == pytest.approx(0.4) and at[1.0] == 0.0
