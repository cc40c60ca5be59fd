"""The request streams ``bench/serving.py`` replays: synthetic Poisson loads and the Azure trace.

A workload is a list of :class:`Request` (arrival offset, prompt and output lengths) plus how to
drive it (open loop at the arrival times, or a closed loop of N streams) and the SLO its goodput
is judged by. Everything is seeded, so two setups in one run, or two runs, get the same load.

Sizes are chosen for the 2-core CPU this project benchmarks on, where SmolLM2-135M prefills
about 250 tokens/s and decodes one batch step in 60-150 ms per core: a workload must keep the
servers busy without queueing without bound, and finish in one to three minutes.
"""

from __future__ import annotations

import csv
import dataclasses
import random
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

WORKLOADS = ("long", "chat", "azure", "c8")


@dataclass(frozen=True)
class Request:
    arrival_s: float  # offset from the start of the run; unused in a closed loop
    prompt_len: int  # tokens (for chat: words, about one token each)
    output_len: int  # exact: requests are sent with ignore_eos
    chat: bool  # /v1/chat/completions with a text message, else /v1/completions with token ids
    seed: int  # picks the prompt's content


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    requests: tuple[Request, ...]
    concurrency: int | None  # closed loop with this many streams; None: open loop
    slo_ttft_s: float
    slo_itl_s: float  # bound on each request's own p99 inter-token gap

    @property
    def offered_rate(self) -> float | None:
        """Requests per second the arrivals ask for (None in a closed loop)."""
        if self.concurrency is not None or len(self.requests) < 2:
            return None
        return (len(self.requests) - 1) / self.requests[-1].arrival_s


@dataclass(frozen=True)
class Sizes:
    """Request counts and length ranges; the quick smoke run shrinks all of them."""

    long_n: int
    # At least the decode daemon's default local-prefill threshold (512), so that under pd
    # every long prompt is prefilled on the prefill core.
    long_prompt: tuple[int, int]
    long_output: tuple[int, int]
    chat_n: int
    chat_prompt: tuple[int, int]
    chat_output: tuple[int, int]
    azure_n: int
    azure_max_prompt: int
    azure_max_output: int
    closed_n: int
    closed_prompt: tuple[int, int]
    closed_output: tuple[int, int]


FULL = Sizes(
    long_n=12, long_prompt=(512, 1024), long_output=(64, 160),
    chat_n=30, chat_prompt=(16, 256), chat_output=(16, 160),
    azure_n=30, azure_max_prompt=2048, azure_max_output=256,
    closed_n=24, closed_prompt=(64, 384), closed_output=(64, 160),
)  # fmt: skip
QUICK = Sizes(
    long_n=6, long_prompt=(512, 768), long_output=(16, 32),
    chat_n=6, chat_prompt=(8, 64), chat_output=(8, 32),
    azure_n=6, azure_max_prompt=512, azure_max_output=32,
    closed_n=8, closed_prompt=(16, 64), closed_output=(16, 32),
)  # fmt: skip


def poisson_arrivals(rng: random.Random, n: int, rate: float) -> list[float]:
    """``n`` arrival offsets of a Poisson process; the first request goes at 0."""
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def synthetic(
    name: str,
    description: str,
    *,
    n: int,
    rate: float | None,
    prompt: tuple[int, int],
    output: tuple[int, int],
    chat: bool,
    seed: int,
    concurrency: int | None = None,
    slo: tuple[float, float],
) -> Workload:
    """Uniform prompt and output lengths; Poisson arrivals at ``rate`` unless closed-loop."""
    # One generator per workload (seeded by its name too) so adding a workload elsewhere
    # never changes this one's requests.
    rng = random.Random(f"{seed}/{name}")
    arrivals = poisson_arrivals(rng, n, rate) if rate else [0.0] * n
    requests = tuple(
        Request(at, rng.randint(*prompt), rng.randint(*output), chat, rng.randrange(1 << 30))
        for at in arrivals
    )
    return Workload(name, description, requests, concurrency, *slo)


@dataclass(frozen=True)
class TraceScaling:
    """How the Azure trace is shrunk to a 2-core machine (reported with the results)."""

    trace: str  # "conv" or "code"
    start: int  # index of the first trace row replayed
    n: int
    rate: float  # target mean arrival rate (req/s); the trace's own gaps are stretched to it
    prompt_div: int  # ContextTokens are divided by this...
    output_div: int  # ...and GeneratedTokens by this
    max_prompt: int  # then capped to fit the model and the run time
    max_output: int


def azure(path: Path, scaling: TraceScaling, seed: int, slo: tuple[float, float]) -> Workload:
    """Replay rows ``start..start+n`` of an Azure LLM inference trace, scaled.

    The trace (Azure 2023; columns TIMESTAMP, ContextTokens, GeneratedTokens) runs at 2.6
    (code) to 5.5 (conv) requests/s with median prompts of 1020-1469 tokens: two orders of
    magnitude more than 2 CPU cores serve. The *shape* is kept: the inter-arrival gaps are
    multiplied by one factor so their mean gives ``rate``, and every length is divided by one
    factor (then capped), so bursts, idle spells and the length mix stay as recorded.
    """
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))[scaling.start : scaling.start + scaling.n]
    if len(rows) < scaling.n:
        raise ValueError(f"{path} has fewer than {scaling.start + scaling.n} rows")
    # The trace has 7 fractional digits; fromisoformat takes at most 6.
    stamps = [datetime.fromisoformat(r["TIMESTAMP"][:26]).timestamp() for r in rows]
    span = stamps[-1] - stamps[0]
    stretch = (len(rows) - 1) / (scaling.rate * span)
    rng = random.Random(f"{seed}/azure")
    requests = tuple(
        Request(
            arrival_s=(at - stamps[0]) * stretch,
            prompt_len=max(1, min(scaling.max_prompt, int(r["ContextTokens"]) // scaling.prompt_div)),
            output_len=max(1, min(scaling.max_output, int(r["GeneratedTokens"]) // scaling.output_div)),
            chat=False,
            seed=rng.randrange(1 << 30),
        )
        for at, r in zip(stamps, rows, strict=True)
    )  # fmt: skip
    description = (
        f"Azure {scaling.trace} trace rows {scaling.start}-{scaling.start + scaling.n - 1}, "
        f"gaps x{stretch:.1f} (mean {scaling.rate} req/s), prompt/{scaling.prompt_div} "
        f"(<= {scaling.max_prompt}), output/{scaling.output_div} (<= {scaling.max_output})"
    )
    return Workload("azure", description, requests, None, *slo)


def build(
    names: list[str],
    *,
    quick: bool,
    seed: int,
    rates: dict[str, float],
    concurrency: int,
    trace_dir: Path,
    trace: str,
    slo: dict[str, tuple[float, float]],
    requests: int | None = None,
) -> list[Workload]:
    """The named workloads, in the order given; ``requests`` replaces every workload's request
    count (a tail percentile of a dozen requests' gaps swings from run to run)."""
    s = QUICK if quick else FULL
    if requests:
        s = dataclasses.replace(
            s, long_n=requests, chat_n=requests, azure_n=requests, closed_n=requests
        )
    out = []
    for name in names:
        if name == "long":
            out.append(synthetic(
                "long", f"completions, prompts {s.long_prompt} tokens, outputs {s.long_output}, "
                f"Poisson {rates['long']} req/s",
                n=s.long_n, rate=rates["long"], prompt=s.long_prompt, output=s.long_output,
                chat=False, seed=seed, slo=slo["long"],
            ))  # fmt: skip
        elif name == "chat":
            out.append(synthetic(
                "chat", f"chat completions, prompts {s.chat_prompt} words, outputs "
                f"{s.chat_output}, Poisson {rates['chat']} req/s",
                n=s.chat_n, rate=rates["chat"], prompt=s.chat_prompt, output=s.chat_output,
                chat=True, seed=seed, slo=slo["chat"],
            ))  # fmt: skip
        elif name == "azure":
            scaling = TraceScaling(
                trace=trace, start=0, n=s.azure_n, rate=rates["azure"],
                prompt_div=4, output_div=2,
                max_prompt=s.azure_max_prompt, max_output=s.azure_max_output,
            )  # fmt: skip
            path = trace_dir / f"AzureLLMInferenceTrace_{trace}.csv"
            out.append(azure(path, scaling, seed, slo["azure"]))
        elif name == "c8":
            out.append(synthetic(
                "c8", f"completions, {concurrency} concurrent streams (closed loop), prompts "
                f"{s.closed_prompt} tokens, outputs {s.closed_output}",
                n=s.closed_n, rate=None, prompt=s.closed_prompt, output=s.closed_output,
                chat=False, seed=seed, concurrency=concurrency, slo=slo["c8"],
            ))  # fmt: skip
        else:
            raise ValueError(f"unknown workload {name!r} (choose from {', '.join(WORKLOADS)})")
    return out
