"""Prefix caches in the simulator: the LRU, the trace reader, the prefix policies, the guard."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner

from edgeinfer.ctl.main import cli
from edgeinfer.router.network import NetworkModel
from edgeinfer.router.prefix_scoring import cached_tokens, leading_hits, under_bound
from edgeinfer.sim import SimError, prefix_policies
from edgeinfer.sim.metrics import load_balance, summary
from edgeinfer.sim.prefix_cache import FleetCaches, hit_rate_bounds, pooled_rate_by_group
from edgeinfer.sim.scenario import WorkloadSpec, run
from edgeinfer.sim.simulator import SimConfig, SimResult
from edgeinfer.sim.topology import Split
from edgeinfer.sim.workload import Workload, compress, mooncake_trace
from sim_helpers import PROFILE, SLO, one_pop, quiet_config, small_world

SAMPLE = Path(__file__).parent / "data" / "mooncake" / "trace_sample.jsonl"
BLOCK = 512


# ---- the cache ------------------------------------------------------------------------------
def test_lru_hits_leading_blocks_and_evicts_least_recent() -> None:
    c = FleetCaches(2, capacity_blocks=4)
    c.insert(0, [1, 2, 3])
    assert c.lookup(0, [1, 2, 9, 3]) == 2  # a gap ends the run
    assert c.lookup(1, [1, 2]) == 0  # another engine's cache
    c.insert(0, [5, 6])  # 5 blocks for 4: the least recent (3, untouched) goes
    assert c.lookup(0, [1, 2, 3]) == 2
    assert c.hits([1, 2, 3]) == {0: 2}
    assert c.hits([5, 6]) == {0: 2}
    c.clear(0)
    assert c.hits([1]) == {} and c.lookup(0, [1]) == 0


def test_lru_evicts_a_chain_tail_first() -> None:
    """The root of a prefix serves every continuation: it outlives its tail."""
    c = FleetCaches(1, capacity_blocks=4)
    c.insert(0, [1, 2, 3, 4])
    c.insert(0, [7])
    assert c.lookup(0, [1, 2, 3, 4]) == 3


def test_leading_hits_per_holder() -> None:
    holders = {1: {"a", "b"}, 2: {"a", "b"}, 3: {"a"}, 4: {"b"}}
    assert leading_hits([1, 2, 3, 4], holders) == {"a": 3, "b": 2}
    assert leading_hits([9, 1], holders) == {}
    assert cached_tokens(1000, 2, BLOCK) == 999  # the last token is always computed
    assert cached_tokens(3000, 2, BLOCK) == 1024


def test_bounded_load_skips_the_hot_daemon_never_all() -> None:
    load = np.array([9.0, 1.0, 1.0, 1.0])
    assert under_bound(load, 1.0, 0.25).tolist() == [False, True, True, True]
    assert under_bound(np.zeros(3), 1.0, 0.25).all()
    assert under_bound(np.array([5.0, 5.0]), 1.0, 0.0).any()


def test_hit_rate_bounds() -> None:
    blocks = [(1, 2), (1, 2, 3), (4,), (1, 2, 3, 5)]
    bounds = hit_rate_bounds(blocks, capacity_blocks=3)
    assert bounds["infinite"] == pytest.approx(5 / 10)
    # Three blocks: (4) pushes out 3 (the tail of 1, 2, 3), so the last hits 1, 2 only.
    assert bounds["pooled"] == pytest.approx(4 / 10)


def test_pooled_rate_by_group_shares_only_within_a_group() -> None:
    blocks = [(1, 2), (1, 2), (1, 2, 3), (1, 2, 3)]
    # Each group's first request finds nothing; the second finds what its group computed.
    assert pooled_rate_by_group(blocks, ["eu", "na", "eu", "na"], {"eu": 8, "na": 8}) == (
        pytest.approx(4 / 10)
    )
    assert pooled_rate_by_group(blocks, ["eu"] * 4, {"eu": 8}) == pytest.approx(7 / 10)
    assert pooled_rate_by_group([], [], {}) == 0.0


# ---- the trace ------------------------------------------------------------------------------
def test_trace_sample_parses() -> None:
    lengths = mooncake_trace(SAMPLE)
    assert len(lengths.t) == 300 and lengths.blocks is not None
    assert lengths.t[0] == 0.0 and (np.diff(lengths.t) >= 0).all()
    assert all(len(b) == -(-p // BLOCK) for b, p in zip(lengths.blocks, lengths.prompt.tolist()))
    half = compress(lengths, 2.0, 1e9)
    np.testing.assert_allclose(half.t, lengths.t / 2)
    cut = compress(lengths, 1.0, 100.0)
    assert (cut.t < 100.0).all() and cut.blocks is not None and len(cut.blocks) == len(cut.t)


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("{not json", "not a trace record"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1}', "not a trace record"),
        ('{"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [1]}',
         "one hash id per 512"),
        ('{"timestamp": -5, "input_length": 10, "output_length": 1, "hash_ids": [1]}',
         "timestamp >= 0"),
        ('{"timestamp": 0, "input_length": "10", "output_length": 1, "hash_ids": [1]}',
         "input_length >= 1"),
    ],
)  # fmt: skip
def test_malformed_trace_lines_name_the_line(tmp_path: Path, line: str, why: str) -> None:
    path = tmp_path / "t.jsonl"
    good = '{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}'
    path.write_text(f"{good}\n{line}\n")
    with pytest.raises(SimError, match=rf"t\.jsonl:2: .*{why}"):
        mooncake_trace(path)


def test_empty_or_missing_trace(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(SimError, match="no requests"):
        mooncake_trace(tmp_path / "empty.jsonl")
    with pytest.raises(SimError, match="cannot read"):
        mooncake_trace(tmp_path / "absent.jsonl")


def test_requests_sharing_a_first_block_come_from_one_place() -> None:
    work = WorkloadSpec("trace", 1.0, 1e9, trace=SAMPLE).build()
    assert len(work) == 300  # a trace is replayed whole, not thinned
    assert work.blocks is not None
    where: dict[int, tuple[float, float]] = {}
    for keys, lat, lon in zip(work.blocks, work.lat.tolist(), work.lon.tolist()):
        assert where.setdefault(keys[0], (lat, lon)) == (lat, lon)


# ---- the simulator and the policies ---------------------------------------------------------
def sessions(n: int, turns: int, gap_s: float, shared: int = 0, seed: int = 0) -> Workload:
    """``n`` conversations from London, each turn 2-4 blocks longer than the last; ``shared``
    blocks of one system prompt in front of every prompt (a hot prefix)."""
    rng = np.random.default_rng(seed)
    t, blocks = [], []
    for s in range(n):
        start, keys = rng.uniform(0, gap_s), list(range(shared))
        for k in range(turns):
            keys = keys + [1000 * (s + 1) + len(keys) + j for j in range(int(rng.integers(2, 5)))]
            t.append(start + k * gap_s + rng.uniform(0, gap_s / 4))
            blocks.append(tuple(keys))
    order = np.argsort(t, kind="stable")
    ts = np.asarray(t)[order]
    bl = tuple(blocks[i] for i in order.tolist())
    prompt = np.array([len(b) * BLOCK for b in bl], dtype=np.int64)
    m = len(ts)
    return Workload(ts, prompt, np.full(m, 20, np.int64), np.full(m, 51.5), np.full(m, -0.1),
                    ["eu"] * m, "sessions", float(ts[-1]), blocks=bl)  # fmt: skip


def hit_rate(res: SimResult) -> float:
    prefix = summary(res, SLO)["prefix"]
    assert prefix is not None
    return float(prefix["block_hit_rate"])


def test_prefill_computes_only_the_uncached_part() -> None:
    keys = tuple(range(8))
    work = Workload(np.array([0.0, 10.0]), np.array([8 * BLOCK] * 2), np.array([2, 2]),
                    np.full(2, 51.5), np.full(2, -0.1), ["eu"] * 2, "twice", 10.0,
                    blocks=(keys, keys))  # fmt: skip
    res = run("router-prefix-blind", one_pop(Split(0, 0, 1)), work, PROFILE, quiet_config(), SLO)
    ttft = res.requests["first"] - work.t
    assert res.counters["prefix_blocks_hit"] == 8
    # The second computes one token instead of 4096.
    assert ttft[1] < ttft[0] / 10


@pytest.fixture(scope="module")
def conversations() -> dict[str, SimResult]:
    work = sessions(40, 5, 6.0)
    return {p: run(p, small_world(), work, PROFILE, SimConfig(seed=3), SLO)
            for p in ("router-prefix-blind", "max-prefix", "session-hash", "prefix-aware")}  # fmt: skip


def test_prefix_policies_hit_more_than_the_blind_router(
    conversations: dict[str, SimResult],
) -> None:
    blind = hit_rate(conversations["router-prefix-blind"])
    for policy in ("max-prefix", "session-hash", "prefix-aware"):
        assert hit_rate(conversations[policy]) > blind + 0.2, policy


def test_session_hash_keeps_a_session_on_one_decode_daemon(
    conversations: dict[str, SimResult],
) -> None:
    res = conversations["session-hash"]
    blocks = res.workload.blocks
    assert blocks is not None
    where: dict[int, int] = {}
    for keys, d in zip(blocks, res.requests["decode"].tolist()):
        assert where.setdefault(keys[0], d) == d


def test_prefix_aware_prefills_the_next_turn_where_the_last_one_was(
    conversations: dict[str, SimResult],
) -> None:
    res = conversations["prefix-aware"]
    blocks = res.workload.blocks
    assert blocks is not None
    last: dict[int, int] = {}
    same = turns = 0
    prefill, decode = res.requests["prefill"].tolist(), res.requests["decode"].tolist()
    for keys, p, d in zip(blocks, prefill, decode):
        e = p if p >= 0 else d  # the engine that computed the prompt
        if keys[0] in last:
            turns += 1
            same += last[keys[0]] == e
        last[keys[0]] = e
    assert same / turns >= 0.7


def test_hot_prefix_is_spread_by_the_load_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    """One 16-block system prompt in front of every request: session-hash sends it all to one
    daemon; without its guard the prefix-aware router piles onto the holders, with it the
    load spreads and the prefix still hits."""
    work = sessions(60, 4, 3.0, shared=16, seed=1)

    def decode_balance(policy: str) -> tuple[float, float]:
        res = run(policy, small_world(), work, PROFILE, SimConfig(seed=1), SLO)
        return summary(res, SLO)["load_max_mean"]["decode"], hit_rate(res)

    assert decode_balance("session-hash")[0] > 10
    guarded, hits = decode_balance("prefix-aware")
    monkeypatch.setattr(prefix_policies, "LOAD_EPS", 1e9)
    unguarded, _ = decode_balance("prefix-aware")
    assert unguarded > 2.2 and guarded < 1.7
    assert hits > 0.6


def test_same_seed_same_placements() -> None:
    work = sessions(20, 4, 4.0)
    a, b = (run("prefix-aware", small_world(), work, PROFILE, SimConfig(seed=5), SLO)
            for _ in range(2))  # fmt: skip
    for key, column in a.requests.items():
        np.testing.assert_array_equal(column, b.requests[key], err_msg=key)
    assert a.counters == b.counters


def test_kv_transfer_uses_the_network_model() -> None:
    """A slower link in the shared NetworkModel slows the simulated transfer too."""
    work = sessions(10, 2, 5.0)
    fast = run("router", small_world(), work, PROFILE, SimConfig(seed=2), SLO)
    slow_net = NetworkModel(intra_pop_gbps=1.0, inter_pop_gbps=1.0)
    slow = run("router", small_world(), work, PROFILE, SimConfig(seed=2, net=slow_net), SLO)
    remote = fast.requests["prefill"] >= 0
    assert remote.any()
    assert np.mean(slow.requests["first"] - slow.workload.t) > np.mean(
        fast.requests["first"] - fast.workload.t
    )


def test_edgectl_sim_trace_reports_hits() -> None:
    args = ["sim", "--trace", str(SAMPLE), "--duration", "60", "--pops", "3", "--hotspot", "",
            "--format", "csv"]  # fmt: skip
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert [r["policy"] for r in rows] == [
        "router-prefix-blind", "max-prefix", "session-hash", "prefix-aware"]  # fmt: skip
    for r in rows:
        assert 0 <= float(r["block_hit_rate"]) <= float(r["pooled_cache_bound"]) + 0.2
    bad = CliRunner().invoke(cli, ["sim", "--trace", str(SAMPLE), "--policy", "bogus"])
    assert bad.exit_code != 0


def test_trace_error_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"timestamp": 0}) + "\n")
    result = CliRunner().invoke(cli, ["sim", "--trace", str(path)])
    assert result.exit_code == 1
    assert "bad.jsonl:1" in result.output


def test_decode_balance_counts_requests_and_decoding_seconds() -> None:
    """Three short answers on one daemon and one long one on the other: the request counts are
    uneven (3 against 1), the seconds spent decoding are not."""
    engine = {"busy_s": 2.0, "prefill_s": 0.0, "decode_s": 2.0, "prompt_tokens": 0.0,
              "generated_tokens": 90.0}  # fmt: skip
    res = SimpleNamespace(
        engines=[{**engine, "role": "decode"}, {**engine, "role": "decode"},
                 {**engine, "role": "prefill", "decode_s": 0.0, "prompt_tokens": 10.0}],
        requests={"decode": np.array([0, 0, 0, 1]), "status": np.zeros(4, dtype=np.int8)},
    )  # fmt: skip
    balance = load_balance(res)  # type: ignore[arg-type]
    assert balance == {"decode": 1.5, "decode_busy": 1.0, "prefill": 1.0}
