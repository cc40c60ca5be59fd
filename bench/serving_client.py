"""The serving benchmark's OpenAI-API client: build each request, stream it, time it.

TTFT is send to first content chunk, ITL the gaps between content chunks, E2E send to last
chunk, all on the client's clock. Open-loop workloads send at their arrival times; closed-loop
ones keep ``concurrency`` streams busy.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from serving_workloads import Request, Workload

# Common words, about one token each, for chat prompts of a chosen length.
WORDS = (
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on", "be",
    "by", "at", "this", "from", "or", "have", "an", "are", "not", "which", "but", "all", "can",
    "they", "more", "one", "had", "were", "will", "about", "if", "would", "their", "there",
    "what", "so", "up", "out", "time", "when", "who", "some", "could", "them", "other", "into",
    "than", "then", "its", "only", "now", "my", "new", "way", "see", "first", "people", "how",
    "may", "use", "very", "well", "because", "make", "water", "long", "just", "over", "after",
    "little", "most", "world",
)  # fmt: skip


@dataclass
class Result:
    start: float  # perf_counter when the request was sent
    ttft_s: float = float("nan")
    e2e_s: float = float("nan")
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None

    @property
    def end(self) -> float:
        return self.start + self.e2e_s


@dataclass(frozen=True)
class Target:
    url: str
    model: str  # the id /v1/models reports
    vocab_size: int


def request_body(target: Target, req: Request) -> tuple[str, dict[str, Any]]:
    """The endpoint and JSON body for ``req``; its content is a pure function of ``req.seed``."""
    rng = random.Random(req.seed)
    common = {
        "model": target.model,
        "max_tokens": req.output_len,
        "ignore_eos": True,  # exact output lengths: every server does the same work
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if req.chat:
        words = " ".join(rng.choice(WORDS) for _ in range(req.prompt_len))
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": words}]}
    # Token ids from the middle of the vocabulary: the low ids are specials and byte tokens.
    lo, hi = target.vocab_size // 64, target.vocab_size * 3 // 4
    prompt = [rng.randrange(lo, hi) for _ in range(req.prompt_len)]
    return "/v1/completions", {**common, "prompt": prompt}


def content_of(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


async def send(session: aiohttp.ClientSession, target: Target, req: Request) -> Result:
    path, body = request_body(target, req)
    res = Result(start=time.perf_counter())
    stamps: list[float] = []
    try:
        async with session.post(target.url + path, json=body) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = orjson.loads(line[6:])
                now = time.perf_counter()
                if "error" in chunk:
                    res.error = str(chunk["error"])[:200]
                    return res
                if content_of(chunk):
                    stamps.append(now)
                if usage := chunk.get("usage"):
                    res.prompt_tokens = usage["prompt_tokens"]
                    res.output_tokens = usage["completion_tokens"]
    except aiohttp.ClientError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    if not stamps:
        res.error = "no content"
        return res
    res.ttft_s = stamps[0] - res.start
    res.e2e_s = stamps[-1] - res.start
    res.itl_s = [b - a for a, b in itertools.pairwise(stamps)]
    return res


async def drive(target: Target, workload: Workload) -> tuple[list[Result], float]:
    """Send the workload (open loop at its arrival times, or closed loop); return results and
    the largest lag of a send behind its scheduled time (a busy client skews open-loop TTFT)."""
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as session:
        loop = asyncio.get_running_loop()
        if workload.concurrency is not None:
            queue = list(reversed(workload.requests))
            results: list[Result] = []

            async def stream() -> None:
                while queue:
                    results.append(await send(session, target, queue.pop()))

            await asyncio.gather(*(stream() for _ in range(workload.concurrency)))
            return results, 0.0
        t0, lag, tasks = loop.time(), 0.0, []
        for req in workload.requests:
            if (delay := t0 + req.arrival_s - loop.time()) > 0:
                await asyncio.sleep(delay)
            lag = max(lag, loop.time() - t0 - req.arrival_s)
            tasks.append(asyncio.create_task(send(session, target, req)))
        return list(await asyncio.gather(*tasks)), lag


async def target_of(url: str, model_dir: Path) -> Target:
    async with aiohttp.ClientSession() as session, session.get(url + "/v1/models") as resp:
        model = (await resp.json())["data"][0]["id"]
    config = orjson.loads((model_dir / "config.json").read_bytes())
    return Target(url, model, int(config["vocab_size"]))


async def warm_up(target: Target, quick: bool) -> None:
    """One short chat and one long completion, unmeasured: first calls pay for lazy
    initialisation (and on pd, for the first KV connection)."""
    long_prompt = 128 if quick else 640  # over the decode daemon's default 512 threshold
    warm = Workload(
        "warm-up", "", (Request(0, 16, 4, True, 1), Request(0, long_prompt, 4, False, 2)), 1, 0, 0
    )
    results, _ = await drive(target, warm)
    if errors := [r.error for r in results if r.error]:
        raise RuntimeError(f"warm-up failed against {target.url}: {errors}")


async def metric(url: str, name: str, labels: str = "") -> float:
    """Sum of a Prometheus sample (0 for servers without it)."""
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as resp:
        text = await resp.text()
    total = 0.0
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] == name and labels in head:
            total += float(value)
    return total
