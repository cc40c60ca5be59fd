"""Continuous batching: which sequences run this step, and how many tokens each.

One unified policy (as in vLLM v1): every step has a token budget. Running sequences go first
(a decode needs one token, an unfinished prefill takes the next chunk), then waiting ones are
admitted FCFS while budget, blocks and the running cap allow. A step that decodes prefills at
most ``max_prefill_tokens_with_decodes`` prompt tokens, so no decoding stream waits behind a
long prefill step (with chunked prefill; 0 lifts the cap). When blocks run out, the most
recently admitted running sequence is preempted: its blocks are freed and it is recomputed
later (its cached prefix usually survives), so a full pool never crashes and never changes an
answer.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from edgeinfer.daemon.engine.block_manager import BlockManager
from edgeinfer.daemon.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """``entries`` pairs each sequence with the number of new tokens it feeds this step."""

    entries: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        max_prefill_tokens_with_decodes: int = 0,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.max_prefill_tokens_with_decodes = max_prefill_tokens_with_decodes
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Admit a sequence whose KV is already in place (a disaggregated decode)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        # Prompt tokens this step may still prefill (the cap applies once anything decodes).
        prefill_budget = budget
        cap = self.max_prefill_tokens_with_decodes
        if (
            cap
            and self.enable_chunked_prefill
            and any(s.num_uncomputed_tokens == 1 for s in self.running)
        ):
            prefill_budget = cap

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq, budget)
            if n > 1:
                n = min(n, prefill_budget)
                if n == 0:
                    i += 1  # its next chunk waits for a step with prefill budget left
                    continue
            while not bm.can_allocate(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is seq:
                    break
            else:
                bm.allocate(seq, seq.num_computed_tokens + n)
                batch.entries.append((seq, n))
                budget -= n
                if n > 1:
                    prefill_budget -= n
                i += 1
                continue
            break  # ``seq`` itself was preempted; everything after it already was too

        # Admitting new work right after a preemption would only thrash the pool.
        while self.waiting and min(budget, prefill_budget) > 0 and not batch.preempted:
            if len(self.running) >= self.max_num_seqs:
                break
            seq = self.waiting[0]
            cached = bm.match_prefix(seq, max_tokens=seq.max_prefix_hit_tokens)
            computed = len(cached) * bm.block_size
            n = min(seq.num_tokens - computed, budget, prefill_budget)
            if n < seq.num_tokens - computed and not self.enable_chunked_prefill:
                if batch.entries:
                    break  # a whole prompt must fit one step; wait for an emptier one
                n = seq.num_tokens - computed
            if not bm.can_allocate(seq, computed + n, cached):
                break
            bm.record_prefix_query(bm.blocks_for(seq.num_tokens - 1) if seq.num_tokens > 1 else 0)
            bm.allocate(seq, computed + n, cached)
            seq.num_computed_tokens = computed
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = computed
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.entries.append((seq, n))
            budget -= n
            prefill_budget -= n
        return batch

    def _chunk(self, seq: Sequence, budget: int) -> int:
        remaining = seq.num_uncomputed_tokens
        if self.enable_chunked_prefill:
            return min(remaining, budget)
        return remaining

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)
        batch.entries = [(s, n) for s, n in batch.entries if s is not seq]
