"""The disaggregation calls of :class:`~edgeinfer.daemon.engine.llm_engine.LLMEngine`.

A request split across two engines: the prefill side exports the KV blocks it computed and
holds them until ``release``; the decode side reserves blocks (reusing its own prefix cache),
imports the arriving pages and commits the first token. Pages may also move the other way
(``kv_pull``): the decode side exports the leading blocks its cache held at the reservation
(pinned by its reserved request until commit or abort), and the prefill side reserves blocks
for them (``reserve_pull``), imports them and starts computing after them (``start_pulled``). Kept apart from the step loop because
only the KV transfer plane calls them; they use the engine's parts, named in :class:`_Engine`.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Protocol

import torch

from edgeinfer.daemon.engine.errors import EngineError
from edgeinfer.daemon.engine.outputs import RequestOutput, TokenLogprob
from edgeinfer.daemon.engine.sampling_params import SamplingParams
from edgeinfer.daemon.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from edgeinfer.daemon.engine.block_manager import BlockManager
    from edgeinfer.daemon.engine.config import EngineConfig
    from edgeinfer.daemon.engine.model_config import ModelConfig
    from edgeinfer.daemon.engine.model_runner import ModelRunner
    from edgeinfer.daemon.engine.parallel.executor import ParallelExecutor
    from edgeinfer.daemon.engine.request_state import RequestState
    from edgeinfer.daemon.engine.scheduler import Scheduler


class _Engine(Protocol):
    config: EngineConfig
    model_config: ModelConfig
    runner: ModelRunner | ParallelExecutor
    block_manager: BlockManager
    scheduler: Scheduler
    _requests: dict[str, RequestState]

    def _new_request(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: SamplingParams,
        prefill_only: bool,
        cache_salt: str | None,
    ) -> RequestState: ...

    def _on_token(
        self, req: RequestState, token: int, logprob: TokenLogprob | None
    ) -> RequestOutput: ...

    def _held(self, request_id: str, *statuses: SequenceStatus) -> Sequence: ...


class StageSplit:
    # ---- disaggregation: prefill side -------------------------------------------------
    def _held(self: _Engine, request_id: str, *statuses: SequenceStatus) -> Sequence:
        req = self._requests.get(request_id)
        if req is None or req.seq.status not in statuses:
            raise EngineError(f"request {request_id!r} holds no KV blocks in that state")
        return req.seq

    def export_kv(
        self: _Engine,
        request_id: str,
        start_block: int,
        end_block: int,
        layers: range | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of logical blocks ``[start_block, end_block)`` per layer: ``[(k, v)]``, each
        ``[n, block_size, num_kv_heads, head_dim]``. Only complete blocks may be read: those
        computed, or, on the decode side of a remote prefill, those its cache held."""
        seq = self._held(
            request_id,
            SequenceStatus.RUNNING,
            SequenceStatus.PREFILLED,
            SequenceStatus.REMOTE_PENDING,
        )
        if seq.status is SequenceStatus.PREFILLED:
            ready = len(seq.block_table)
        elif seq.status is SequenceStatus.REMOTE_PENDING:
            ready = seq.num_held_tokens // self.config.block_size
        else:
            ready = seq.num_computed_tokens // self.config.block_size
        if not 0 <= start_block <= end_block <= ready:
            raise EngineError(
                f"blocks [{start_block}, {end_block}) of {request_id!r} are not ready"
            )
        return self.runner.kv_cache.read_blocks(seq.block_table[start_block:end_block], layers)

    def release(self: _Engine, request_id: str) -> None:
        """Free a prefilled request's held blocks (its KV was shipped, or the peer gave up)."""
        seq = self._held(request_id, SequenceStatus.PREFILLED)
        seq.status = SequenceStatus.FINISHED
        self.block_manager.free(seq)
        del self._requests[request_id]

    def reserve_pull(
        self: _Engine,
        request_id: str,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        *,
        cache_salt: str | None,
        offered_blocks: int,
        worth_pulling: Callable[[int], bool],
    ) -> range:
        """Prefill side: reserve a prefill-only request's blocks up to the ``offered_blocks``
        leading blocks its peer holds, when ``worth_pulling(blocks beyond this cache's hit)``.
        Returns the logical blocks to receive (``import_kv``, then ``start_pulled``); empty:
        nothing reserved, add the request as usual. One token always stays to compute (it
        yields the first token's logits), as for a prefix-cache hit."""
        req = self._new_request(request_id, prompt_token_ids, params, True, cache_salt)
        seq = req.seq
        bm = self.block_manager
        cached = bm.match_prefix(seq, max_tokens=seq.max_prefix_hit_tokens)
        end = min(offered_blocks, seq.max_prefix_hit_tokens // bm.block_size)
        own = len(cached)
        if (
            end <= own
            or not bm.can_allocate(seq, end * bm.block_size, cached)
            or not worth_pulling(end - own)
        ):
            bm.forget(seq)
            return range(0)
        bm.record_prefix_query(bm.blocks_for(seq.num_tokens - 1))  # as at an admission
        bm.allocate(seq, end * bm.block_size, cached)
        seq.num_held_tokens = own * bm.block_size
        seq.status = SequenceStatus.REMOTE_PENDING
        self._requests[request_id] = req
        return range(own, end)

    def start_pulled(self: _Engine, request_id: str, *, cacheable: bool) -> None:
        """The pulled pages are in place: compute the rest of the prompt after them.
        ``cacheable``: they came from a trusted peer and may join this prefix cache; if not,
        neither they nor any block computed after them (it attended to them) ever does."""
        seq = self._held(request_id, SequenceStatus.REMOTE_PENDING)
        seq.num_computed_tokens = len(seq.block_table) * self.config.block_size
        # Not computed here: the first token's num_computed must not count them.
        seq.num_cached_tokens = seq.num_computed_tokens
        if cacheable:
            self.block_manager.cache_full_blocks(seq)
        else:
            self.block_manager.keep_private(seq)
        self.scheduler.add_running(seq)

    # ---- disaggregation: decode side --------------------------------------------------
    def reserve_remote(
        self: _Engine,
        request_id: str,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
    ) -> int:
        """Allocate blocks for a prompt prefilled elsewhere; returns how many leading tokens
        this engine already holds (whole blocks, under ``cache_salt``), which the prefill side
        need not send."""
        req = self._new_request(request_id, prompt_token_ids, params, False, cache_salt)
        seq = req.seq
        bm = self.block_manager
        cached = bm.match_prefix(seq)
        if not bm.can_allocate(seq, seq.num_tokens, cached):
            bm.forget(seq)
            raise EngineError("not enough free KV blocks to reserve for a remote prefill")
        bm.record_prefix_query(bm.blocks_for(seq.num_tokens))
        bm.allocate(seq, seq.num_tokens, cached)
        seq.num_held_tokens = len(cached) * bm.block_size
        seq.status = SequenceStatus.REMOTE_PENDING
        self._requests[request_id] = req
        return seq.num_held_tokens

    def import_kv(
        self: _Engine,
        request_id: str,
        start_block: int,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Write pages ``k``/``v`` ``[n, bs, Hkv, D]`` of one layer at logical block
        ``start_block`` onwards; blocks shared through the prefix cache are never written."""
        seq = self._held(request_id, SequenceStatus.REMOTE_PENDING)
        n = k.shape[0]
        first_private = seq.num_held_tokens // self.config.block_size
        if start_block < first_private or start_block + n > len(seq.block_table):
            raise EngineError(
                f"KV pages for blocks [{start_block}, {start_block + n}) fall outside the "
                f"writable range [{first_private}, {len(seq.block_table)}) of {request_id!r}"
            )
        if not 0 <= layer < self.model_config.num_layers:
            raise EngineError(f"layer {layer} out of range")
        self.runner.kv_cache.write_blocks(
            seq.block_table[start_block : start_block + n], layer, k, v
        )

    def commit_remote(
        self: _Engine,
        request_id: str,
        first_token: int,
        logprob: TokenLogprob | None = None,
        *,
        num_cached_tokens: int = 0,
    ) -> RequestOutput:
        """All pages arrived: account the prompt as computed and start decoding.
        ``num_cached_tokens``: the prompt tokens the prefill side's prefix cache held, the only
        ones computed nowhere for this request (it computed those held here too)."""
        seq = self._held(request_id, SequenceStatus.REMOTE_PENDING)
        req = self._requests[request_id]
        seq.num_cached_tokens = min(max(num_cached_tokens, 0), seq.num_prompt_tokens)
        seq.num_computed_tokens = seq.num_tokens
        self.block_manager.cache_full_blocks(seq)
        self.scheduler.add_running(seq)
        # The prefill side drew the first token from its copy of this seed: skip that draw so
        # the rest of the sequence matches a single engine's.
        seq.sampling.skip_draw(self.model_config.vocab_size, self.runner.device)
        return self._on_token(req, first_token, logprob)
