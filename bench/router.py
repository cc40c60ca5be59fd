"""Router benchmark (not a test): placement decisions per second on one core, and the latency
a real router process adds to a streamed response (``router_latency.py``).

Synthetic world: ``--pops`` PoPs (default 300) spread over the inhabited latitudes, each with a
prefill and a decode daemon and every third with a ``both`` daemon too, all fed through real
heartbeats into a :class:`PopRegistry`. Load is drawn per daemon (busy batches, some queues, a
few draining or silent). Requests come from clients scattered around random PoPs with log-normal
prompt lengths.

Two measurements, in decisions per CPU second of the (single-threaded) benchmark process, each
the best (and the median) of ten rounds, because a shared host perturbs single rounds:

* ``static``: decisions against one snapshot, nothing recorded (the selector alone);
* ``churn``: the production loop: one heartbeat applied every ``daemons / (interval * rate)``
  decisions, i.e. every daemon beating every 5 s at the measured rate, so snapshot rebuilds are
  paid for, and every decision recorded in the registry's ledger of pending placements (as the
  proxy does) on a clock advancing at that rate, so the per-placement row updates, the ledger
  and its absorption by heartbeats are paid for too.

``prefix hits`` (in ``decisions``): the static decisions again, each request's prefix held by
two daemons (the selector's prefix path), and again with churn (``prefix_hits_churn``); their
ratio to the prefix-blind static rate is measured in the same run, so host noise mostly cancels. ``tokenize``: rendering a chat, encoding it and
hashing its blocks as the router does before placing it, per 1k prompt tokens.

``latency``: p50/p99 of TTFT and of whole streamed responses, direct to a fake daemon vs through
an ``edge-router`` process without API keys vs through one with keys and every limit on (never
reached), in the same run, and the keys-on/keys-off ratio of the added p99 (see
``router_latency.py``).

``snapshot_update_ms_*`` (in ``decisions``): what a batch of load-only heartbeats costs before
the next decision: the registry's new snapshot with the arrays carried over, against the same
snapshot's arrays built afresh (what every new snapshot cost before).

Prints a table and merges its results into ``bench/results/router.json`` (other measurements of
this file keep their keys).

    .venv/bin/python bench/router.py [--run decisions|latency] [--pops 300] [--quick]
"""

from __future__ import annotations

import os

# One core means one thread: keep BLAS from fanning out before numpy loads.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import zlib  # noqa: E402
from collections.abc import Callable, Collection  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from edgeinfer.router.geo import GeoPoint  # noqa: E402
from edgeinfer.router.network import NetworkModel, unit_vectors  # noqa: E402
from edgeinfer.router.pop_registry import DaemonView, PopConfig, PopRegistry  # noqa: E402
from edgeinfer.router.prefix_index import PrefixIndex, U64Array  # noqa: E402
from edgeinfer.router.prepared import Prepared, prepared  # noqa: E402
from edgeinfer.router.selector import (  # noqa: E402
    PlacementConfig,
    PrefixHits,
    RequestFeatures,
    record_placement,
    select,
)
from edgeinfer.shared.heartbeat import Heartbeat  # noqa: E402
from router_latency import bench_latency  # noqa: E402
from router_prefix import bench_tokenize  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "router.json"
TARGET_DECISIONS_PER_S = 20_000
HEARTBEAT_INTERVAL_S = 5.0
MODEL = "m"


def synthetic_pops(n: int, rng: random.Random) -> list[PopConfig]:
    """``n`` PoPs on a Fibonacci lattice between 45 S and 65 N (where people and PoPs are)."""
    pops = []
    golden = math.pi * (3 - math.sqrt(5))
    lo, hi = math.sin(math.radians(-45)), math.sin(math.radians(65))
    for i in range(n):
        lat = math.degrees(math.asin(lo + (hi - lo) * (i + 0.5) / n))
        lon = (math.degrees(i * golden) + 180) % 360 - 180
        urls = [f"http://pop{i}-prefill:8000", f"http://pop{i}-decode:8000"]
        urls += [f"http://pop{i}-both:8000"] if i % 3 == 0 else []
        pops.append(PopConfig(f"pop{i}", round(lat, 4), round(lon, 4), tuple(urls)))
    return pops


def synthetic_heartbeat(url: str, pop: str, seq: int, rng: random.Random) -> Heartbeat:
    role = "prefill" if "-prefill" in url else "decode" if "-decode" in url else "both"
    total = 8192
    running = rng.randint(0, 48)
    waiting = rng.choice([0] * 9 + [rng.randint(1, 20)])
    return Heartbeat(
        daemon_id=url,
        pop=pop,
        role=role,
        model=MODEL,
        kv_endpoint=None
        if role == "decode"
        else url.replace("http", "tcp").replace("8000", "5600"),
        running=running,
        waiting=waiting,
        kv_blocks_free=rng.randint(0 if waiting else 200, total),
        kv_blocks_total=total,
        block_size=16,
        prefill_tokens_per_s=rng.uniform(8_000, 20_000),
        decode_tokens_per_s=rng.uniform(800, 3_000),
        ttft_p50_s=rng.uniform(0.05, 0.5),
        itl_p50_s=rng.uniform(0.01, 0.05),
        queued_prefill_tokens=int(rng.expovariate(1 / 4000)),
        # A drain is an operator's action that lasts minutes: the same ~5% of daemons in every
        # heartbeat, not a coin flipped per beat (that would be a drain or an undrain, and a
        # snapshot rebuild, in every tenth heartbeat).
        draining=zlib.crc32(url.encode()) % 20 == 0,
        drained=False,
        in_flight=running + waiting,
        kv_bytes_per_token=131_072,
        local_prefill_threshold=512,
        prefill_chunk_tokens=2048,
        tokenizer_id="bench",
        prefix_caching=False,
        kv_event_seq=0,
        seq=seq,
        started_at=1.7e9,
        sent_at=1.7e9 + seq,
    )


def _requests(
    pops: list[PopConfig], n: int, rng: random.Random
) -> list[tuple[GeoPoint, RequestFeatures]]:
    out = []
    for _ in range(n):
        pop = rng.choice(pops)
        lat = max(-90.0, min(90.0, pop.lat + rng.gauss(0, 3)))
        lon = (pop.lon + rng.gauss(0, 3) + 180) % 360 - 180
        prompt = min(32_000, max(1, int(rng.lognormvariate(math.log(800), 1.2))))
        out.append((GeoPoint(lat, lon), RequestFeatures(prompt, 256, MODEL)))
    return out


def bench_decisions(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(0)
    pops = synthetic_pops(args.pops, rng)
    registry = PopRegistry(pops, here=pops[0].name, heartbeat_interval_s=HEARTBEAT_INTERVAL_S)
    now = 1000.0
    daemons = [(url, pop.name) for pop in pops for url in pop.daemons]
    for url, pop in daemons:
        # ~3% silent: their last heartbeat is older than three periods.
        seen = now - 20.0 if rng.random() < 0.03 else now
        registry.update(synthetic_heartbeat(url, pop, 0, rng), seen)
    for pop in pops[::4]:
        registry.record_rtt(pop.name, rng.uniform(0.005, 0.2))
    net, cfg, sel_rng = NetworkModel(), PlacementConfig(), random.Random(1)
    reqs = _requests(pops, 4096, rng)
    n = 20_000 if args.quick else 200_000

    rounds = 10
    seqs = dict.fromkeys((u for u, _ in daemons), 1)
    # The registry's clock goes on from one churn run to the next, as a router's does: run
    # back from where the last one ended, every placement the ledger still holds would be in
    # the future, never absorbed by a heartbeat.
    clock = [now]

    def run(churn_every: int | None) -> list[float]:
        """Decisions per CPU second of this process, per round. CPU time, not wall time, and
        several rounds: on a shared host other processes take turns on the core."""
        rates = []
        start_t = clock[0] if churn_every else now
        views, i = registry.snapshot(start_t), 0
        pending = registry.pending if churn_every else None
        # Simulated seconds per decision: heartbeats every churn_every decisions are the
        # daemons' 5 s period at this rate.
        tick = len(daemons) / HEARTBEAT_INTERVAL_S * churn_every if churn_every else 0.0
        for _ in range(rounds):
            start = time.process_time()
            for _ in range(n // rounds):
                t = start_t + i / tick if churn_every else now
                if churn_every and i % churn_every == 0:
                    url, pop = daemons[(i // churn_every) % len(daemons)]
                    registry.update(synthetic_heartbeat(url, pop, seqs[url], rng), t)
                    seqs[url] += 1
                    views = registry.snapshot(t)
                client, feats = reqs[i % len(reqs)]
                found = select(views, client, feats, net, cfg, sel_rng, pops[0].name,
                               pending=pending, now=t if pending else None)  # fmt: skip
                if not found:
                    raise RuntimeError("benchmark world has no placement for a request")
                if pending is not None:
                    record_placement(pending, found[0], feats, t)
                i += 1
            rates.append(n // rounds / (time.process_time() - start))
        if churn_every:
            clock[0] = start_t + i / tick
        return rates

    static = run(None)
    # The same decisions knowing the prompt's prefix (prefix_select's path): two daemons
    # anywhere hold it, one all of its blocks, one 80%.
    plain = list(reqs)
    held = [v.url for v in registry.snapshot(now) if v.role != "prefill"]
    for k, (client, f) in enumerate(plain):
        blocks = f.prompt_tokens // 16
        hits = {held[(k * 7) % len(held)]: blocks * 4 // 5, held[(k * 13) % len(held)]: blocks}
        reqs[k] = (client, RequestFeatures(f.prompt_tokens, f.max_tokens, f.model,
                                           PrefixHits(f.prompt_tokens, blocks, 16, hits)))  # fmt: skip
    with_prefix = run(None)
    beats_per_s = len(daemons) / HEARTBEAT_INTERVAL_S
    # The production loop with prefix hits: heartbeats at the rate the prefix path decides.
    prefix_churn = run(max(1, int(statistics.median(with_prefix) / beats_per_s)))
    # As the router runs: the index asked about the selector's candidates only
    # (PrefixHits.lookup). Every daemon holds 2,000 other blocks; the prefix is held by a decode
    # daemon of the client's nearest PoP (a conversation's earlier turn placed there: all of
    # it) and one elsewhere (80%).
    via_index = bench_prefix_index(registry.snapshot(now), pops, plain, reqs)
    carried_ms, built_ms = bench_snapshot_update(pops, rng)
    with_index = run(None)
    reqs[:] = plain
    churn = run(max(1, int(statistics.median(static) / beats_per_s)))
    views = registry.snapshot(now)
    return {
        "pops": len(pops),
        "daemons": len(daemons),
        "available_daemons": sum(v.available for v in views),
        "decisions": n,
        "decisions_per_s_static": round(max(static)),
        "decisions_per_s_static_median": round(statistics.median(static)),
        "decisions_per_s_churn": round(max(churn)),
        "decisions_per_s_churn_median": round(statistics.median(churn)),
        "decisions_per_s_prefix_hits": round(max(with_prefix)),
        "decisions_per_s_prefix_hits_median": round(statistics.median(with_prefix)),
        "decisions_per_s_prefix_hits_churn": round(max(prefix_churn)),
        "decisions_per_s_prefix_hits_churn_median": round(statistics.median(prefix_churn)),
        "decisions_per_s_prefix_index_median": round(statistics.median(with_index)),
        "prefix_index_daemons_asked_mean": via_index(),
        # Same run, same host: what the prefix path costs against the prefix-blind one.
        "prefix_hits_vs_blind_static": round(
            statistics.median(with_prefix) / statistics.median(static), 3
        ),
        "us_per_decision_static": round(1e6 / max(static), 2),
        "heartbeats_per_s_in_churn": beats_per_s,
        # A new snapshot after 7 load-only heartbeats (~50 ms of them at 700 daemons): the
        # arrays carried over vs built afresh, medians.
        "snapshot_update_ms_carried": round(carried_ms, 3),
        "snapshot_update_ms_built": round(built_ms, 3),
        "target_decisions_per_s": TARGET_DECISIONS_PER_S,
        "meets_target": min(max(static), max(churn)) >= TARGET_DECISIONS_PER_S,
    }


def bench_snapshot_update(pops: list[PopConfig], rng: random.Random) -> tuple[float, float]:
    """Milliseconds from a batch of 7 load-only heartbeats to arrays a decision can use: the
    registry's next snapshot and its arrays carried over (``LoadArrays.carry``), against the
    same snapshot's arrays built afresh. Medians of 300 snapshots."""
    registry = PopRegistry(pops, here=pops[0].name, heartbeat_interval_s=HEARTBEAT_INTERVAL_S,
                           coalesce_s=0.0)  # fmt: skip
    now = 1000.0
    daemons = [(url, pop.name) for pop in pops for url in pop.daemons]
    for url, pop in daemons:
        registry.update(synthetic_heartbeat(url, pop, 0, rng), now)
    net, cfg = NetworkModel(), PlacementConfig()
    prepared(registry.snapshot(now), net, cfg, registry.pending).arrays(MODEL, now)
    carried, built = [], []
    for i in range(300):
        t = now + (i + 1) * 0.003  # 300 snapshots inside REBUILD_S: every one is carried
        for k in range(7):
            url, pop = daemons[(7 * i + k) % len(daemons)]
            registry.update(synthetic_heartbeat(url, pop, i + 1, rng), t)
        start = time.perf_counter()
        views = registry.snapshot(t)
        a = prepared(views, net, cfg, registry.pending).arrays(MODEL, t)
        carried.append(time.perf_counter() - start)
        start = time.perf_counter()
        Prepared(views, net, cfg, registry.pending).arrays(MODEL, t)
        built.append(time.perf_counter() - start)
        if a.built_at != now:
            raise RuntimeError("the arrays were built again, not carried over")
    return statistics.median(carried) * 1e3, statistics.median(built) * 1e3


def bench_prefix_index(
    views: list[DaemonView], pops: list[PopConfig],
    plain: list[tuple[GeoPoint, RequestFeatures]], reqs: list[tuple[GeoPoint, RequestFeatures]],
) -> Callable[[], float]:  # fmt: skip
    """Rewrite ``reqs`` to carry index lookups (module doc); returns the mean number of
    daemons the selector asked about per lookup, once the requests have run."""
    rng = np.random.default_rng(0)
    index = PrefixIndex()
    for v in views:
        index.replace(v.url, np.unique(rng.integers(0, 2**63, 2000, dtype=np.uint64)))
    xyz = unit_vectors([p.lat for p in pops], [p.lon for p in pops])
    decode = [v.url for v in views if v.role != "prefill"]
    by_pop = {v.pop: v.url for v in views if v.role == "decode"}
    asked = [0, 0]

    def counted(q: U64Array) -> Callable[[Collection[str]], dict[str, int]]:
        def lookup(daemons: Collection[str]) -> dict[str, int]:
            asked[0] += len(daemons)
            asked[1] += 1
            return index.lookup(q, daemons)

        return lookup

    for k, (client, f) in enumerate(plain):
        blocks = f.prompt_tokens // 16
        if not blocks:
            reqs[k] = (client, f)
            continue
        q = rng.integers(0, 2**63, blocks, dtype=np.uint64)
        near = pops[int((xyz @ unit_vectors(client.lat, client.lon)).argmax())].name
        for url, n in (
            (by_pop.get(near), blocks),
            (decode[(k * 13) % len(decode)], blocks * 4 // 5),
        ):
            if url is not None and n:
                index.apply(url, q[:n], q[:0])
        px = PrefixHits(f.prompt_tokens, blocks, 16, {}, counted(q))
        reqs[k] = (client, RequestFeatures(f.prompt_tokens, f.max_tokens, f.model, px))
    return lambda: round(asked[0] / max(asked[1], 1), 1)


MEASUREMENTS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "decisions": bench_decisions,
    "latency": bench_latency,
    "tokenize": lambda args: bench_tokenize(args.quick),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--run", action="append", choices=sorted(MEASUREMENTS), help="repeatable; default all"
    )
    parser.add_argument("--pops", type=int, default=300)
    parser.add_argument("--quick", action="store_true", help="fewer iterations (smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--pin", type=int, help="CPU to pin to (Linux); the work is one thread")
    args = parser.parse_args()
    if args.pin is not None:
        os.sched_setaffinity(0, {args.pin})
    results: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {}
    results["host"] = {"python": platform.python_version(), "machine": platform.machine()}
    for name in args.run or sorted(MEASUREMENTS):
        results[name] = MEASUREMENTS[name](args)
        print(f"{name}:")
        for key, value in results[name].items():
            print(f"  {key:28} {value}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
