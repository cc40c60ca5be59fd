"""The engine: a step-wise API over scheduler, block manager, model runner and sampler.

Single-threaded by design: one owner (a thread of the daemon, a benchmark loop) calls
``add_request``/``abort_request``/``step`` and the disaggregation calls; :mod:`async_engine`
wraps it for asyncio. Disaggregated serving splits a request across two engines (the calls
live in :mod:`stage_split`):

* prefill side: ``add_request(..., prefill_only=True)``; each step's output says how many
  leading KV blocks are complete (``kv_blocks_ready``) so ``export_kv`` can ship them while
  later chunks compute; the request ends ``prefilled`` with its first token and holds its
  blocks until ``release``.
* decode side: ``reserve_remote`` allocates blocks (reusing its own prefix cache and saying how
  many tokens it already holds), ``import_kv`` writes arriving pages, ``commit_remote`` adds
  the first token and starts decoding.

Every request may carry a ``cache_salt``: only requests with equal salts share prefix-cache
blocks (see :mod:`block_manager`). Salting changes which blocks are reused, never a token.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from edgeinfer.daemon.engine.block_manager import BlockManager
from edgeinfer.daemon.engine.config import EngineConfig
from edgeinfer.daemon.engine.default_model import resolve_model
from edgeinfer.daemon.engine.errors import InvalidRequestError
from edgeinfer.daemon.engine.model_config import ModelConfig
from edgeinfer.daemon.engine.model_runner import ModelRunner
from edgeinfer.daemon.engine.outputs import EngineStats, RequestOutput, TokenLogprob
from edgeinfer.daemon.engine.parallel.executor import ParallelExecutor
from edgeinfer.daemon.engine.prompt_logprobs import score_prompt_positions
from edgeinfer.daemon.engine.request_state import RequestState
from edgeinfer.daemon.engine.sampler import Sampler, SamplingState
from edgeinfer.daemon.engine.sampling_params import SamplingParams
from edgeinfer.daemon.engine.scheduler import Scheduler
from edgeinfer.daemon.engine.sequence import FinishReason, Sequence, SequenceStatus
from edgeinfer.daemon.engine.stage_split import StageSplit
from edgeinfer.daemon.engine.structured import GrammarCompiler
from edgeinfer.daemon.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class Completion:
    """A finished request, as the synchronous :meth:`LLMEngine.generate` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None
    num_cached_tokens: int
    prompt_logprobs: list[TokenLogprob | None] | None = None


class LLMEngine(StageSplit):
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model_dir = resolve_model(config.model, show_progress=config.show_progress)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        self.runner: ModelRunner | ParallelExecutor
        if config.tensor_parallel * config.pipeline_parallel > 1:
            self.runner = ParallelExecutor(config, self.model_config, self.model_dir)
        else:
            self.runner = ModelRunner(config, self.model_config, self.model_dir)
        self.max_model_len = config.resolve_max_model_len(self.model_config)
        self.block_manager = BlockManager(
            self.runner.kv_cache.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
            max_prefill_tokens_with_decodes=config.max_prefill_tokens_with_decodes,
        )
        self.sampler = Sampler()
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        # Constrained decoding (built lazily on the first constrained request).
        self.grammars = GrammarCompiler.from_dir(
            self.model_dir, self.model_config.vocab_size, self.eos_token_ids
        )
        self._requests: dict[str, RequestState] = {}
        self._num_preemptions = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._decode_tokens = 0  # generated tokens that are not a request's first

    @property
    def kv_layout(self):
        return self.runner.layout

    # ---- requests -------------------------------------------------------------------
    def encode_chat(self, messages: list[dict[str, object]], **template_vars: object) -> list[int]:
        """Token ids of a chat rendered with the checkpoint's template. The template writes
        its own special tokens, so the tokenizer must not add a second BOS."""
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, **template_vars
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    def add_request(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        *,
        prefill_only: bool = False,
        cache_salt: str | None = None,
    ) -> int:
        """Queue a request; returns its prompt length in tokens."""
        req = self._new_request(
            request_id, prompt, params or SamplingParams(), prefill_only, cache_salt
        )
        self._requests[request_id] = req
        self.scheduler.add(req.seq)
        return req.seq.num_prompt_tokens

    def _new_request(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: SamplingParams,
        prefill_only: bool,
        cache_salt: str | None,
    ) -> RequestState:
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate_prompt(ids, params, prefill_only)
        seq = Sequence(
            request_id=request_id,
            token_ids=ids,
            params=params,
            sampling=SamplingState(
                params,
                ids,
                self.eos_token_ids,
                self.grammars.matcher(params.structured) if params.structured else None,
            ),
            prefill_only=prefill_only,
            cache_salt=cache_salt,
        )
        return RequestState(seq, self.tokenizer)

    def _validate_prompt(self, ids: list[int], params: SamplingParams, prefill_only: bool) -> None:
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 or t >= vocab for t in ids):
            raise InvalidRequestError(
                f"prompt token ids must be integers in [0, {vocab})", param="prompt"
            )
        n = len(ids)
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt is {n} tokens but the model's context is {self.max_model_len} tokens",
                param="prompt",
            )
        want = 1 if prefill_only else params.max_tokens
        if n + want > self.max_model_len:
            raise InvalidRequestError(
                f"max_tokens={params.max_tokens} with a {n}-token prompt exceeds the "
                f"{self.max_model_len}-token context (at most {self.max_model_len - n})",
                param="max_tokens",
            )
        need = self.block_manager.blocks_for(n + want)
        if need > self.block_manager.num_blocks:
            raise InvalidRequestError(
                f"the request needs {need} KV blocks but the cache holds "
                f"{self.block_manager.num_blocks}",
                param="max_tokens",
            )

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request at once and free its blocks; None if it is unknown or over."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        return self._finish(req, FinishReason.ABORT, None, RequestOutput(request_id))

    def check_health(self) -> None:
        """Raise :class:`EngineError` when steps can no longer run (a worker rank died)."""
        self.runner.check_health()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    # ---- one step -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        self._num_preemptions += len(batch.preempted)
        if not batch:
            return []
        logits, samplers = self.runner.execute(batch)
        if logits.shape[0] > len(samplers):
            scored = score_prompt_positions(logits[len(samplers) :], batch.entries)
            for seq, index, score in scored:
                self._requests[seq.request_id].record_prompt_logprob(index, score)
            logits = logits[: len(samplers)]
        for seq, n in batch.entries:
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self._prompt_tokens += min(n, seq.num_prompt_tokens - seq.num_computed_tokens)
            seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq)
        outputs: list[RequestOutput] = []
        if samplers:
            result = self.sampler.sample(logits, [s.sampling for s in samplers])
            for i, seq in enumerate(samplers):
                top = result.top_logprobs[i]
                lp = result.logprobs[i]
                logprob = (
                    None if lp is None else TokenLogprob(result.token_ids[i], lp, tuple(top or ()))
                )
                outputs.append(
                    self._on_token(self._requests[seq.request_id], result.token_ids[i], logprob)
                )
        sampled = {id(s) for s in samplers}
        for seq, _ in batch.entries:
            if seq.prefill_only and id(seq) not in sampled:
                outputs.append(self._progress(seq))
        return outputs

    def _progress(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(
            seq.request_id,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            kv_blocks_ready=seq.num_computed_tokens // self.config.block_size,
        )

    def _on_token(
        self, req: RequestState, token: int, logprob: TokenLogprob | None
    ) -> RequestOutput:
        seq = req.seq
        self._generation_tokens += 1
        if seq.num_output_tokens:  # a first token ends the prefill; the rest are decode's
            self._decode_tokens += 1
        out = self._progress(seq)
        out.new_token_ids.append(token)
        if logprob is not None:
            out.new_logprobs = [logprob]
        out.prompt_logprobs = req.take_prompt_logprobs()
        if seq.prefill_only:
            seq.token_ids.append(token)
            seq.sampling.append(token)
            out.kv_blocks_ready = len(seq.block_table)
            return self._finish(req, FinishReason.PREFILLED, None, out)
        reason, stop_reason = req.append_token(token, self.max_model_len)
        if reason is None and seq.sampling.constraint_finished:
            reason = FinishReason.STOP  # the grammar is complete: nothing more may follow
        out.new_text = req.take_text(final=reason is not None)
        out.num_output_tokens = seq.num_output_tokens
        if reason is None:
            return out
        return self._finish(req, reason, stop_reason, out)

    def _finish(
        self,
        req: RequestState,
        reason: FinishReason,
        stop_reason: str | int | None,
        out: RequestOutput,
    ) -> RequestOutput:
        seq = req.seq
        self.scheduler.remove(seq)
        out.finished = True
        out.finish_reason = reason.value
        out.stop_reason = stop_reason
        out.num_output_tokens = seq.num_output_tokens
        seq.finish_reason = reason
        if reason is FinishReason.PREFILLED:
            seq.status = SequenceStatus.PREFILLED  # blocks held until release()
            return out
        seq.status = SequenceStatus.FINISHED
        self.block_manager.free(seq)
        del self._requests[seq.request_id]
        return out

    # ---- helpers --------------------------------------------------------------------
    def cached_prefix_tokens(
        self, prompt_token_ids: Seq[int], *, cache_salt: str | None = None
    ) -> int:
        """How many leading tokens of a prompt the prefix cache holds now under
        ``cache_salt`` (a check only)."""
        probe = Sequence(
            "__probe__",
            list(prompt_token_ids),
            SamplingParams(),
            SamplingState(SamplingParams()),
            cache_salt=cache_salt,
        )
        try:
            return len(self.block_manager.match_prefix(probe)) * self.config.block_size
        finally:
            self.block_manager.forget(probe)

    @property
    def prompt_tokens_computed(self) -> int:
        return self._prompt_tokens

    @property
    def generation_tokens(self) -> int:
        return self._generation_tokens

    @property
    def decode_tokens(self) -> int:
        """Generated tokens past each request's first: the inter-token gaps' tokens."""
        return self._decode_tokens

    def stats(self) -> EngineStats:
        held = [r for r in self._requests.values() if r.seq.status is SequenceStatus.PREFILLED]
        pending = [
            r for r in self._requests.values() if r.seq.status is SequenceStatus.REMOTE_PENDING
        ]
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_remote_pending=len(pending),
            num_prefilled_held=len(held),
            kv_blocks_total=bm.num_blocks,
            kv_blocks_used=bm.num_used_blocks,
            prefix_cache_queries=bm.prefix_queries,
            prefix_cache_hits=bm.prefix_hits,
            num_preemptions=self._num_preemptions,
            prompt_tokens_computed=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            queued_prompt_tokens=sum(
                max(s.num_prompt_tokens - s.num_computed_tokens, 0)
                for s in (*self.scheduler.waiting, *self.scheduler.running)
            ),
        )

    def prompt_logits(self, token_ids: Seq[int]) -> torch.Tensor:
        """Float32 logits ``[T, vocab]`` at every prompt position (no caching; for checks)."""
        seq = Sequence(
            "__logits__", list(token_ids), SamplingParams(), SamplingState(SamplingParams())
        )
        self.block_manager.allocate(seq, seq.num_tokens)
        try:
            return self.runner.prompt_logits(seq)
        finally:
            self.block_manager.free(seq)

    def generate(
        self,
        prompts: Iterable[str | Seq[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        cache_salt: str | None = None,
    ) -> list[Completion]:
        """Run prompts to completion together (continuous batching); results in input order."""
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params_list = [params or SamplingParams()] * len(prompts)
        else:
            params_list = list(params)
        ids = [f"gen-{i}" for i in range(len(prompts))]
        acc = {rid: Completion(rid, [], [], "", None, None, 0) for rid in ids}
        for rid, prompt, p in zip(ids, prompts, params_list, strict=True):
            self.add_request(rid, prompt, p, cache_salt=cache_salt)
            acc[rid].prompt_token_ids = list(self._requests[rid].seq.prompt_token_ids)
        while self.has_unfinished_requests():
            for out in self.step():
                c = acc[out.request_id]
                c.token_ids.extend(out.new_token_ids)
                c.text += out.new_text
                if out.new_logprobs:
                    c.logprobs = (c.logprobs or []) + out.new_logprobs
                c.num_cached_tokens = out.num_cached_tokens
                if out.prompt_logprobs is not None:
                    c.prompt_logprobs = out.prompt_logprobs
                if out.finished:
                    c.finish_reason = out.finish_reason
        return [acc[rid] for rid in ids]
