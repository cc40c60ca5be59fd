"""One GPU's engine as a server: continuous batching, chunked prefill, KV capacity.

Each step decodes one token for every running sequence and computes up to the token budget of
queued prompt chunks (FIFO), as the real scheduler does; its duration comes from the profile.
Steps that only decode are identical but for one more context token per sequence, so a run of
them up to the next finisher is one event; anything joining cuts the run at the step boundary.
A request is admitted (FIFO, head-of-line) when its prompt + output fits in free KV blocks and a
sequence slot is free; it then holds the blocks until it finishes. Decode progress is one
counter per engine: a sequence joining at count c with n tokens to go finishes at c + n, kept in
a heap, so a step costs O(finishers) whatever the batch size.

Prefill jobs are ``[request, tokens done, home engine]``; the home engine is the decode side,
so a job computed here for another engine is handed back to the simulator.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Protocol

from edgeinfer.shared.heartbeat import Role
from edgeinfer.sim.events import STEP_END, Requests
from edgeinfer.sim.profile import EngineProfile

Job = list[int]  # [request, prompt tokens done, home engine]: mutated in place per chunk


class Simulated(Protocol):
    """What an engine calls back into (the simulator)."""

    def push(self, t: float, kind: int, a: int, b: int, c: float) -> None: ...

    def send_prefill(self, r: int, now: float) -> None: ...

    def prefilled(self, job: Job, now: float) -> None: ...

    def cached(self, r: int, e: int) -> int: ...

    def computed(self, r: int, e: int) -> None: ...

    def finished(self, r: int, engine: Engine) -> None: ...


class Engine:
    __slots__ = (
        "alive", "block_size", "busy", "counter", "ctx_sum", "finish", "idx", "joins", "kv_free",
        "kv_total", "max_seqs", "n_admitted", "n_running", "pieces", "pop", "prefill_q", "prof",
        "queued_tokens", "reqs", "role", "sim", "stats", "step_a", "step_batch", "step_c",
        "step_id", "step_k", "step_prefill", "step_t0", "url", "waiting", "window",
    )  # fmt: skip

    def __init__(
        self, idx: int, url: str, pop: int, role: Role, prof: EngineProfile, kv_tokens: int,
        max_seqs: int, reqs: Requests, sim: Simulated,
    ) -> None:  # fmt: skip
        self.idx, self.url, self.pop, self.role, self.prof = idx, url, pop, role, prof
        self.block_size, self.max_seqs, self.reqs, self.sim = 16, max_seqs, reqs, sim
        self.kv_total = kv_tokens // self.block_size
        # stats: busy s, prefill part s, decode part s, prompt tokens, generated tokens
        self.stats = [0.0, 0.0, 0.0, 0.0, 0.0]
        self.alive, self.step_id = True, 0
        self.reset()

    def reset(self) -> None:
        """Empty state: at start, and when a failed engine comes back (its work was lost)."""
        self.waiting: deque[int] = deque()
        self.prefill_q: deque[Job] = deque()
        self.finish: list[tuple[int, int]] = []
        self.joins: list[int] = []
        self.pieces: list[tuple[Job, int]] = []
        self.kv_free, self.n_admitted, self.n_running = self.kv_total, 0, 0
        self.counter, self.ctx_sum, self.queued_tokens, self.step_batch = 0, 0, 0, 0
        # The step (or run of identical decode steps) in progress: started at t0, k steps,
        # step j lasts a + c*j, share of its time that is prefill work.
        self.busy, self.step_t0, self.step_k, self.step_a, self.step_c = False, 0.0, 0, 0.0, 0.0
        self.step_prefill = 0.0
        # Heartbeat window: busy s with prefill, prompt tokens, busy s with decode, generated,
        # steps with decode, and the last rates measured (kept while idle, as the daemon does).
        self.window = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
        self.step_id += 1  # step events of the old state are void

    def arrive(self, r: int, now: float) -> None:
        self.waiting.append(r)
        self.admit(now)

    def admit(self, now: float) -> None:
        reqs, waiting = self.reqs, self.waiting
        while waiting and self.n_admitted < self.max_seqs:
            r = waiting[0]
            need = reqs.blocks[r]
            if need > self.kv_free:
                break
            waiting.popleft()
            self.kv_free -= need
            self.n_admitted += 1
            if reqs.prefill[r] < 0:
                self.enqueue([r, 0, self.idx], now)
            else:
                self.sim.send_prefill(r, now)

    def enqueue(self, job: Job, now: float) -> None:
        # A prefix this engine caches is not computed again; a job for another engine comes
        # with its start decided (the simulator looks up both caches and may pull pages).
        if job[1] == 0 and job[2] == self.idx:
            job[1] = self.sim.cached(job[0], self.idx)
        self.prefill_q.append(job)
        self.queued_tokens += self.reqs.prompt[job[0]] - job[1]
        if not self.busy:
            self.start_step(now)
        else:
            self._cut(now)

    def join(self, r: int, now: float) -> None:
        """Request ``r`` has its first token (its KV is here): it decodes from the next step."""
        self.reqs.first[r] = now
        if self.busy:
            self.joins.append(r)
            self._cut(now)
        else:
            self._merge(r, now)
            self.start_step(now)

    def _merge(self, r: int, now: float) -> None:
        reqs = self.reqs
        if reqs.output[r] <= 1:
            self._done(r, now)
            return
        heapq.heappush(self.finish, (self.counter + reqs.output[r] - 1, r))
        self.n_running += 1
        self.ctx_sum += reqs.prompt[r] + 1

    def _done(self, r: int, now: float) -> None:
        reqs = self.reqs
        reqs.last[r] = now
        reqs.status[r] = 1
        self.kv_free += reqs.blocks[r]
        self.n_admitted -= 1
        self.sim.finished(r, self)

    def start_step(self, now: float) -> None:
        batch, prof = self.n_running, self.prof
        budget = prof.max_num_batched_tokens - batch
        pieces: list[tuple[Job, int]] = []
        prefill_s = 0.0
        prompt = self.reqs.prompt
        for job in self.prefill_q:
            if budget <= 0:
                break
            done = job[1]
            n = min(budget, prompt[job[0]] - done)
            pieces.append((job, n))
            prefill_s += prof.prefill_s(n, done)
            budget -= n
        if not batch and not pieces:
            self.busy = False
            return
        self.busy, self.pieces, self.step_batch, self.step_t0 = True, pieces, batch, now
        if pieces:
            decode_s = prof.decode_s(batch, self.ctx_sum) if batch else 0.0
            fixed = prof.fixed_s(batch > 0, True)
            self.step_k, self.step_a, self.step_c = 1, fixed + decode_s + prefill_s, 0.0
            self.step_prefill = prefill_s / (decode_s + prefill_s) if decode_s + prefill_s else 1
        else:
            # Pure decode: every step until the next finisher is the same batch, one context
            # token longer per sequence each time, so the run is one event (an arithmetic sum).
            self.step_k = self.finish[0][0] - self.counter
            self.step_a = prof.decode_fixed_s + prof.decode_s(batch, self.ctx_sum)
            self.step_c = prof.decode_context_token_s * batch
            self.step_prefill = 0.0
        self._schedule()

    def _run_s(self, k: int) -> float:
        """Duration of the first ``k`` steps of the current run."""
        return k * self.step_a + self.step_c * k * (k - 1) / 2

    def _schedule(self) -> None:
        self.step_id += 1
        end = self.step_t0 + self._run_s(self.step_k)
        self.sim.push(end, STEP_END, self.idx, self.step_id, 0.0)

    def _cut(self, now: float) -> None:
        """Something joins: end the run of decode steps at the step in progress, so it is
        taken at the next step boundary as continuous batching does."""
        if self.step_k <= 1:
            return
        dt, a, c = now - self.step_t0, self.step_a, self.step_c
        # Steps completed by now: the largest j with a*j + c*j*(j-1)/2 <= dt.
        j = (
            int(dt / a)
            if c == 0
            else int((-(a - c / 2) + math.sqrt((a - c / 2) ** 2 + 2 * c * dt)) / c)
        )
        if j + 1 < self.step_k:
            self.step_k = j + 1
            self._schedule()

    def step_end(self, now: float) -> None:
        batch, k, w, st = self.step_batch, self.step_k, self.window, self.stats
        run = now - self.step_t0
        st[0] += run
        st[1] += run * self.step_prefill
        st[2] += run * (1 - self.step_prefill)
        if self.pieces:
            w[0] += run
        if batch:
            self.counter += k
            self.ctx_sum += batch * k
            w[2] += run
            w[3] += batch * k
            w[4] += k
            st[4] += batch * k
            heap, counter, reqs = self.finish, self.counter, self.reqs
            while heap and heap[0][0] <= counter:
                r = heapq.heappop(heap)[1]
                self.n_running -= 1
                self.ctx_sum -= reqs.prompt[r] + reqs.output[r]
                self._done(r, now)
        prompt = self.reqs.prompt
        for job, n in self.pieces:
            job[1] += n
            self.queued_tokens -= n
            w[1] += n
            st[3] += n
            r = job[0]
            if job[1] >= prompt[r]:
                self.prefill_q.popleft()  # chunks are taken in order: a finished job is first
                self.sim.computed(r, self.idx)
                if job[2] == self.idx:
                    self.reqs.first[r] = now
                    self._merge(r, now)
                else:
                    self.sim.prefilled(job, now)
        self.pieces = []
        for r in self.joins:
            self._merge(r, now)
        self.joins.clear()
        self.admit(now)
        self.start_step(now)

    def counts(self) -> tuple[int, int]:
        """Running (decoding or prefilling here) and waiting requests."""
        return self.n_running + min(len(self.prefill_q), self.max_seqs), len(self.waiting)

    def rates(self) -> tuple[float, float, float | None]:
        """Prefill and decode tokens per busy s, mean decode step (the ITL); resets the window
        (called once per heartbeat)."""
        w = self.window
        if w[0] > 0:
            w[5] = w[1] / w[0]
        if w[2] > 0:
            w[6] = w[3] / w[2]
        itl = w[2] / w[4] if w[4] else None
        w[0] = w[1] = w[2] = w[3] = w[4] = 0.0
        return w[5], w[6], itl
