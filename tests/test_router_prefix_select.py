"""The selector with prefix hits (prefix_select) and with a session-affinity hint."""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter

import pytest

from edgeinfer.router import prefix_lookup, selector
from edgeinfer.router.inflight import RECENT_S, PlacementLedger
from edgeinfer.router.placement import PlacementConfig
from edgeinfer.router.prefix_index import PrefixIndex
from edgeinfer.router.prefix_lookup import PrefixLookup
from edgeinfer.router.prefix_scoring import rank
from edgeinfer.router.selector import PrefixHits, RequestFeatures, record_placement, select
from edgeinfer.router.session_affinity import AffinityRing, affinity_key
from test_router_selector import LONDON, NET, World

URLS = tuple(f"http://lon-{i}:8000" for i in range(1, 5))
CFG = PlacementConfig()


def _world(**beat) -> World:
    w = World({"lon": URLS})
    for u in URLS:
        w.beat(u, running=0, in_flight=0, **beat)
    return w


def _place(w: World, f: RequestFeatures, seed: int = 0, cfg: PlacementConfig = CFG):
    views = w.reg.snapshot(w.now)
    return select(views, LONDON, f, NET, cfg, random.Random(seed), "lon",
                  pending=w.reg.pending, now=w.now)  # fmt: skip


def _hits(prompt: int, held: dict[str, int]) -> RequestFeatures:
    return RequestFeatures(prompt, 16, "m", PrefixHits(prompt, prompt // 16, 16, held))


def test_the_daemon_holding_the_prefix_takes_it_and_computes_only_the_suffix() -> None:
    w = _world(prefill_tokens_per_s=2000.0)
    for seed in range(10):
        best = _place(w, _hits(800, {URLS[2]: 40}), seed)[0]
        assert best.decode.url == URLS[2] and best.prefill is None
        assert (best.decode_cached, best.computed_tokens) == (640, 160)
        assert best.breakdown["prefill_compute_s"] == 160 / 2000.0
        assert "cached tokens prefill 640 decode 640" in best.describe()


def test_a_prefill_daemon_holding_the_prefix_sends_only_what_decode_lacks() -> None:
    w = _world(prefill_tokens_per_s=2000.0)
    # Decode holds 10 blocks, so the pages of 30 move; prefill on the holder of 40 computes 160.
    # Roles make the pair the only way: URLS[1] may only prefill, URLS[0] only decode; the
    # other prefill daemons are slower, even receiving decode's 10 blocks instead of computing.
    w.beat(URLS[1], role="prefill", running=0, in_flight=0, prefill_tokens_per_s=2000.0)
    w.beat(URLS[0], role="decode", running=0, in_flight=0, local_prefill_threshold=0)
    for u in URLS[2:]:
        w.beat(u, role="prefill", running=0, in_flight=0, prefill_tokens_per_s=1000.0)
    f = _hits(800, {URLS[0]: 10, URLS[1]: 40})
    (p,) = _place(w, f)
    assert (p.decode.url, p.prefill and p.prefill.url) == (URLS[0], URLS[1])
    assert (p.prefill_cached, p.decode_cached, p.computed_tokens) == (640, 160, 160)
    assert p.breakdown["kv_s"] > 0


def test_a_prefill_daemon_is_priced_receiving_what_its_decode_daemon_holds() -> None:
    # The decode daemon holds the whole conversation (50 blocks), the prefill daemons none of
    # it: inside a PoP the pages cost less to receive than to recompute, so the pair is priced
    # with the pull (kv_pull), as the daemons will run it.
    w = _world(prefill_tokens_per_s=2000.0)
    w.beat(URLS[0], role="decode", running=0, in_flight=0, local_prefill_threshold=0)
    for u in URLS[1:]:
        w.beat(u, role="prefill", running=0, in_flight=0, prefill_tokens_per_s=2000.0)
    f = _hits(801, {URLS[0]: 50})
    (p,) = _place(w, f)
    assert p.decode.url == URLS[0] and p.prefill is not None
    assert (p.prefill_cached, p.decode_cached, p.computed_tokens) == (800, 800, 1)
    assert p.breakdown["prefill_compute_s"] == 1 / 2000.0
    # The pull's time is on the prefill side's queue: the pages first, then the suffix.
    assert 0 < p.breakdown["prefill_queue_s"] < 800 / 2000.0


def test_equal_hits_spread_by_load_and_the_guard_caps_a_hot_prefix() -> None:
    w = _world(prefill_tokens_per_s=50_000.0)
    held = dict.fromkeys(URLS[:2], 20)  # a hot system prompt on two of four daemons
    got: Counter[str] = Counter()
    for i in range(40):
        f = _hits(400, held)
        best = _place(w, f, seed=i)[0]
        record_placement(w.reg.pending, best, f, w.now)
        got[best.decode.url] += 1
    assert set(got) == set(URLS)  # the guard spills to the daemons without it
    mean = sum(got.values()) / len(URLS)
    # under_bound's one request of slack, and the request that is then placed there.
    assert max(got.values()) <= 1.25 * mean + 2, got
    assert got[URLS[0]] > 0 and got[URLS[1]] > 0


def test_first_turns_sharing_a_system_prompt_spread_evenly_over_its_holders() -> None:
    # Every daemon holds the system prompt and is idle when each conversation starts (the
    # previous answers are in): loads tie, so recent placements decide, and each daemon takes
    # the same number of conversations (two random choices gave 4/3/3/2 at seed 0).
    for seed in range(8):
        w = _world(prefill_tokens_per_s=2000.0)
        got: Counter[str] = Counter()
        for i in range(12):
            f = _hits(1100, dict.fromkeys(URLS, 64))
            best = _place(w, f, seed=seed * 100 + i)[0]
            record_placement(w.reg.pending, best, f, w.now)
            got[best.decode.url] += 1
            w.now += 10.0  # the answer is in: the next heartbeats show every daemon idle
            for u in URLS:
                w.beat(u, running=0, in_flight=0, prefill_tokens_per_s=2000.0)
        assert sorted(got.values()) == [3, 3, 3, 3], (seed, got)


def test_ties_go_to_the_least_loaded_then_the_least_recently_used() -> None:
    ttft = [1.0, 1.0, 1.005, 1.01, 2.0]
    load = [2.0, 0.0, 1.0, 0.0, 0.0]
    allowed = [True] * 5
    recent = [0.0, 3.0, 0.0, 1.0, 0.0]
    for seed in range(20):
        order = rank(ttft, load, allowed, 0.02, random.Random(seed), 5, None, recent.__getitem__)
        assert order[0] == 3, order  # least loaded of the near-ties, then least recent
        assert order[1:] == [0, 1, 2, 4]
    # Without recent placements, equal loads are drawn at random.
    firsts = {rank(ttft, load, allowed, 0.02, random.Random(s))[0] for s in range(40)}
    assert firsts == {1, 3}


def test_the_ledger_counts_recent_placements_with_decay() -> None:
    ledger = PlacementLedger(report_lag_s=1.0)
    assert ledger.recent("d", 0.0) == 0.0
    ledger.record(10.0, "d", "p", 100, 200, 0.01, 0.02, 0.05)
    ticket = ledger.record(10.0, "d", None, 100, 200, 0.01, 0.0, 0.05)
    assert ledger.recent("d", 10.0) == 2.0 and ledger.recent("p", 10.0) == 0.0
    assert ledger.recent("d", 10.0 + RECENT_S) == pytest.approx(2.0 / math.e)
    ledger.record(5.0, "d", None, 100, 200, 0.01, 0.0, 0.05)  # late: no decay backwards
    assert ledger.recent("d", 10.0) == 3.0
    ledger.cancel(ticket)  # it never got there
    assert ledger.recent("d", 10.0) == pytest.approx(2.0)


def test_without_hits_the_prefix_blind_path_is_taken() -> None:
    w = _world()
    f = _hits(800, {})
    assert _place(w, f)[0].computed_tokens is None


def test_holders_that_cannot_place_leave_the_request_to_the_prefix_blind_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The prefix path found holders but no pair within its load guard (queues grown since the
    # pool was chosen, at a high decision rate): the request is placed without prefix
    # knowledge, not refused.
    monkeypatch.setattr(selector, "select_with_prefix", lambda *args: [])
    placed = _place(_world(), _hits(800, {URLS[0]: 50}))
    assert placed and placed[0].computed_tokens is None


def test_session_affinity_keeps_a_session_on_one_daemon_within_the_bound() -> None:
    w = _world()
    key = affinity_key("tenant", "session-1")
    f = dataclasses.replace(RequestFeatures(100, 16, "m"), affinity=key)
    first = {_place(w, f, seed)[0].decode.url for seed in range(10)}
    assert len(first) == 1
    # Sessions spread: not all of 40 sessions pick one daemon.
    picks = {_place(w, dataclasses.replace(f, affinity=affinity_key("t", str(i))))[0].decode.url
             for i in range(40)}  # fmt: skip
    assert len(picks) >= 3
    # Loaded past the bound, the session's daemon passes it on.
    (url,) = first
    w.beat(url, running=40, in_flight=40)
    assert _place(w, f)[0].decode.url != url


def test_affinity_keys_are_per_tenant_and_ignore_bad_ids() -> None:
    assert affinity_key("a", "s") != affinity_key("b", "s")
    assert affinity_key("a", "") == affinity_key("a", None) == affinity_key("a", "x" * 300) == 0
    ring = AffinityRing(list(URLS))
    assert ring.pick(affinity_key("a", "s"), [0.0] * 4, 0.25) in range(4)
    assert AffinityRing([]).pick(1, [], 0.25) is None


def test_a_decode_daemon_prefills_locally_up_to_its_own_threshold() -> None:
    w = _world()
    for u in URLS[2:]:
        w.beat(u, role="prefill", running=0, in_flight=0)
    w.beat(URLS[1], role="prefill", running=0, in_flight=0)
    w.beat(URLS[0], role="decode", running=0, in_flight=0, local_prefill_threshold=1000)
    assert _place(w, RequestFeatures(800, 16, "m"))[0].prefill is None
    w.beat(URLS[0], role="decode", running=0, in_flight=0, local_prefill_threshold=100)
    assert _place(w, RequestFeatures(800, 16, "m"))[0].prefill is not None
    # With prefix hits the uncached suffix is what the threshold is compared with.
    best = _place(w, _hits(800, {URLS[0]: 45}))[0]
    assert best.prefill is None and best.computed_tokens == 80


def test_session_affinity_stays_in_the_pop_placement_prefers() -> None:
    far = ("http://sea-1:8000", "http://sea-2:8000")
    w = World({"lon": URLS, "sea": far})
    for u in URLS + far:
        w.beat(u, running=0, in_flight=0)
    for i in range(30):
        f = dataclasses.replace(RequestFeatures(100, 16, "m"), affinity=affinity_key("t", str(i)))
        assert _place(w, f)[0].decode.url in URLS


def test_the_index_is_asked_about_candidates_only_and_a_miss_is_prefix_blind() -> None:
    pops = {"lon": URLS, "sea": ("http://sea-1:8000", "http://sea-2:8000"),
            "cgq": ("http://cgq-1:8000", "http://cgq-2:8000")}  # fmt: skip
    w = World(pops)
    for urls in pops.values():
        for u in urls:
            w.beat(u, running=0, in_flight=0, prefill_tokens_per_s=2000.0)
    cfg = dataclasses.replace(CFG, prefix_lookup_candidates=2, decode_candidates=2,
                              prefill_pool=1)  # fmt: skip
    asked: list[set[str]] = []

    def lookup(held: dict[str, int]):
        def ask(candidates):
            asked.append(set(candidates))
            return {u: n for u, n in held.items() if u in candidates}

        return ask

    def feats(held: dict[str, int]) -> RequestFeatures:
        return RequestFeatures(800, 16, "m", PrefixHits(800, 50, 16, {}, lookup(held)))

    # Nothing held among the candidates: the prefix-blind placement.
    blind = _place(w, RequestFeatures(800, 16, "m"), cfg=cfg)[0]
    missed = _place(w, feats({"http://cgq-1:8000": 50}), cfg=cfg)[0]
    assert missed.computed_tokens is None and missed.decode.url == blind.decode.url
    everyone = {u for urls in pops.values() for u in urls}
    assert asked[-1] < everyone and "http://cgq-1:8000" not in asked[-1]
    # A candidate holding it takes it.
    (held,) = [u for u in URLS if u in asked[-1] and u != blind.decode.url][:1]
    best = _place(w, feats({held: 40, "http://cgq-1:8000": 50}), cfg=cfg)[0]
    assert best.decode.url == held and best.decode_cached == 640


def test_a_daemon_above_the_load_bound_places_when_none_within_it_can() -> None:
    # Decode daemons only, no prefill daemon: those within the bound may not prefill 640 tokens
    # themselves (threshold 0), so the busy one above it, which may, takes the request.
    w = World({"lon": URLS})
    for u in URLS:
        w.beat(u, role="decode", running=0, in_flight=0, local_prefill_threshold=0)
    w.beat(URLS[3], role="decode", running=40, in_flight=40, local_prefill_threshold=10_000)
    (p,) = _place(w, _hits(800, {URLS[0]: 10}))[:1]
    assert (p.decode.url, p.prefill, p.computed_tokens) == (URLS[3], None, 800)


@pytest.mark.asyncio
async def test_the_tokenizer_group_is_worked_out_once_per_snapshot(monkeypatch) -> None:
    # Scanning every daemon for those that tokenise alike costs ~0.2 ms at 700 daemons: once
    # per registry snapshot (a new list whenever a view changes), not once per request.
    scans: list[int] = []
    scan = prefix_lookup._tokenizer_group

    def counted(views, model):
        scans.append(len(views))
        return scan(views, model)

    monkeypatch.setattr(prefix_lookup, "_tokenizer_group", counted)
    w = _world(tokenizer_id="tok-a", block_size=16)
    lookup = PrefixLookup(PrefixIndex(), None, None, None)
    try:
        views = w.reg.snapshot(w.now)
        body = {"prompt": "hi"}
        for _ in range(3):  # no tokenizer fetched (no session): no hits, but the group is known
            assert await lookup.lookup("/v1/completions", body, None, views, "m") is None
        assert lookup._group(views, "m") == ("tok-a", 16, set(URLS))
        assert scans == [4]
        w.beat(URLS[0], tokenizer_id="tok-a", block_size=16, running=3)
        fresh = w.reg.snapshot(w.now)
        assert fresh is not views
        await lookup.lookup("/v1/completions", body, None, fresh, "m")
        assert scans == [4, 4]
        # A plain list may be changed in place: scanned every time.
        plain = list(fresh)
        lookup._group(plain, "m")
        lookup._group(plain, "m")
        assert scans == [4, 4, 4, 4]
    finally:
        await lookup.close()
