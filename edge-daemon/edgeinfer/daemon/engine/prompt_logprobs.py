"""Log-probs of prompt tokens (vLLM's ``prompt_logprobs``, and ``echo`` with ``logprobs``).

The runner appends, after the samplers' logits rows, one row per prompt position whose request
asked for prompt logprobs (:meth:`Sequence.prompt_logprob_positions`, in ``batch.entries``
order). The row at position ``p`` is the model's distribution of token ``p + 1``; this module
turns those rows into one :class:`TokenLogprob` per scored prompt token, with its rank and the
request's ``k`` most likely alternatives. Log-probs are the raw model distribution, as for
sampled tokens (no penalties, no temperature).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from edgeinfer.daemon.engine.outputs import TokenLogprob
from edgeinfer.daemon.engine.sequence import Sequence


def score_prompt_positions(
    logits: torch.Tensor, entries: Seq[tuple[Sequence, int]]
) -> list[tuple[Sequence, int, TokenLogprob]]:
    """``(seq, prompt index, logprob)`` for every prompt-logprob row of ``logits`` ``[P, V]``;
    call before the step's tokens are counted as computed."""
    spans = []
    for seq, n in entries:
        span = seq.prompt_logprob_positions(n)
        if span:
            spans.append((seq, span))
    if not spans:
        return []
    device = logits.device
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(
        [seq.token_ids[p + 1] for seq, span in spans for p in span], device=device
    )
    chosen = logprobs.gather(1, targets.unsqueeze(1))
    # 1 + the tokens strictly more likely: vLLM's rank.
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    k = max(seq.params.prompt_logprobs or 0 for seq, _ in spans)
    top_vals_l: list[list[float]] = [[] for _ in range(len(ranks))]
    top_ids_l: list[list[int]] = [[] for _ in range(len(ranks))]
    if k:
        top_vals, top_ids = logprobs.topk(k, dim=-1)
        top_vals_l, top_ids_l = top_vals.tolist(), top_ids.tolist()
    chosen_l = chosen[:, 0].tolist()
    out = []
    row = 0
    for seq, span in spans:
        n = seq.params.prompt_logprobs or 0
        for p in span:
            top = tuple(zip(top_ids_l[row][:n], top_vals_l[row][:n], strict=True))
            out.append(
                (seq, p + 1, TokenLogprob(seq.token_ids[p + 1], chosen_l[row], top, ranks[row]))
            )
            row += 1
    return out
