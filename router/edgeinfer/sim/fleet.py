"""What daemons tell the router and what happens to PoPs: heartbeats, failures, drains.

Heartbeats are real :class:`Heartbeat` objects into the real registry, so staleness, the
``kv_full`` state and drains reach the selector exactly as in production. As the daemon does
(``daemon.load_report``), a heartbeat carries the counts of a load snapshot refreshed twice per
period, on its own clock, and the rates of the moment. A failed PoP stops
beating and is placed on until its daemons go stale (three periods) or a placement's connect
fails; its in-flight requests are lost and counted, and prefill jobs it held for other PoPs fall
back to their decode daemon, as the daemon does when its prefill peer disappears.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from edgeinfer.shared.heartbeat import Heartbeat
from edgeinfer.sim.events import FAILED, PENDING, POP_DRAIN, POP_FAIL, POP_RECOVER
from edgeinfer.sim.servers import Engine

if TYPE_CHECKING:
    from edgeinfer.sim.simulator import Simulation

CLOCK0 = 1_000.0  # registry clock at simulated t=0 (any positive origin works)
MODEL = "sim-model"
LOCAL_PREFILL_THRESHOLD = 512  # the daemons' default, advertised in their heartbeats


def warm_rates(sim: Simulation, e: Engine) -> None:
    """Rates as if the daemon had been serving already: a full prefill chunk, a batch of 16."""
    prof, chunk = sim.prof, sim.prof.max_num_batched_tokens
    e.window[5] = chunk / prof.prompt_s(chunk)
    e.window[6] = 16 / (prof.decode_fixed_s + prof.decode_s(16, 16 * 1024))


def refresh(sim: Simulation, e: Engine) -> None:
    """The daemon's periodic copy of its engine's counts, which its heartbeats report."""
    running, waiting = e.counts()
    sim.stats[e.idx] = (running, waiting, e.kv_free, e.queued_tokens, len(sim.inflight[e.idx]))


def heartbeat(sim: Simulation, e: Engine, now: float) -> None:
    if not e.alive:
        return
    running, waiting, kv_free, queued, in_flight = sim.stats[e.idx]
    prefill_rate, decode_rate, itl = e.rates()
    sim.hb_seq[e.idx] += 1
    host = e.url.removeprefix("http://").removesuffix(":8000")
    hb = Heartbeat(
        daemon_id=e.url, pop=sim.topo.pops[e.pop].name, role=e.role,
        model=MODEL, kv_endpoint=None if e.role == "decode" else f"tcp://{host}:5600",
        running=running, waiting=waiting, kv_blocks_free=kv_free, kv_blocks_total=e.kv_total,
        block_size=e.block_size, prefill_tokens_per_s=prefill_rate,
        decode_tokens_per_s=decode_rate, ttft_p50_s=None, itl_p50_s=itl,
        queued_prefill_tokens=queued, draining=False, drained=False,
        in_flight=in_flight, kv_bytes_per_token=sim.prof.kv_bytes_per_token,
        local_prefill_threshold=LOCAL_PREFILL_THRESHOLD,
        prefill_chunk_tokens=sim.prof.max_num_batched_tokens, tokenizer_id=MODEL,
        prefix_caching=sim.caches is not None, kv_event_seq=0, seq=sim.hb_seq[e.idx],
        started_at=sim.incarnation[e.idx], sent_at=sim.incarnation[e.idx] + now,
    )  # fmt: skip
    sim.registry.update(hb, CLOCK0 + now)


def fail(sim: Simulation, e: Engine, now: float) -> None:
    e.alive = False
    status = sim.reqs.status
    for r in sim.inflight[e.idx]:
        if status[r] == PENDING:
            status[r] = FAILED
            sim.counters["failed_in_flight"] += 1
    sim.inflight[e.idx].clear()
    orphans = [job for job in e.prefill_q if job[2] != e.idx and status[job[0]] == PENDING]
    e.reset()
    if sim.caches is not None:
        sim.caches.clear(e.idx)
    for job in orphans:
        sim.fallback(job[0], now)


def outage(sim: Simulation, kind: int, pop: int, on: int, now: float) -> None:
    engines = [e for e in sim.engines if e.pop == pop]
    if kind == POP_FAIL:
        for e in engines:
            fail(sim, e, now)
    elif kind == POP_RECOVER:
        for e in engines:
            # A restarted process: empty, unmeasured, a new incarnation for the registry.
            e.alive = True
            e.reset()
            sim.incarnation[e.idx] += 1.0
            sim.hb_seq[e.idx] = 0
            refresh(sim, e)
            heartbeat(sim, e, now)
    elif kind == POP_DRAIN:
        sim.registry.drain_pop(sim.topo.pops[pop].name, bool(on))
