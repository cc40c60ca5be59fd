"""Prefix-aware placement with real processes (not a test): does a conversation's next turn
find its history cached?

A router and three PoPs (one ``both`` daemon each, the built-in model; ``--model tiny`` for a
quick run) on 127.0.0.1. Conversations of several turns all open with the same ~1k-token
system prompt; each turn appends the model's answer and a new user message, so the history
grows (``--document-tokens``: each conversation's first message also carries a document of its
own, as RAG and agents send). A conversation's next turn joins the back of the queue when its
answer is in, so turns of different conversations interleave as users' do. The same workload
runs with the router's prefix-blind selector (``prefix_aware_placement = false``) and
prefix-aware, each on fresh processes (cold caches), alternating for ``--rounds``: on a shared
machine the neighbours' load drifts over minutes.

Per setup: TTFT p50 of turn 1 and of the later turns (client clock: send to first content
chunk), the later turns' ``usage.prompt_tokens_details.cached_tokens`` over their history (the
previous turn's prompt and answer) and their uncached tokens, and requests per daemon (max /
mean). Targets (issue 17): later-turn TTFT p50 blind / aware >= 2x, cached >= 80% of the
history, max / mean <= 1.25. The PoPs are a few hundred km apart, so geography orders them but
load decides (a network RTT of a few ms against prefill times of hundreds).

Prints a summary with the host's CPU flags and load average (the machine may be shared: the
load average says how much) and writes ``bench/results/prefix_routing.json``.

    .venv/bin/python bench/prefix_routing.py --model tiny --rounds 1   # ~1 minute
    .venv/bin/python bench/prefix_routing.py                           # SmolLM2, ~10 minutes
    .venv/bin/python bench/prefix_routing.py --rounds 1 --document-tokens 1000 \
        --out bench/results/prefix_routing_documents.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import secrets
import statistics
import subprocess
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from prefix_routing_network import POPS, Network, http_post, metric, network
from serving_client import WORDS, content_of

RESULTS = Path(__file__).parent / "results" / "prefix_routing.json"
SETUPS = ("blind", "aware")
REQUEST_TIMEOUT_S = 600.0
TOKENIZE_METRICS = (
    "edgeinfer_router_tokenize_tokens_total",
    "edgeinfer_router_tokenize_tokens_cached_total",
)


@dataclass
class Turn:
    conversation: int
    turn: int  # 1-based
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    history_tokens: int  # the previous turn's prompt and answer (0 on the first turn)
    pop: str  # the daemon that served it (one per PoP)


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def system_prompt(n_words: int) -> str:
    """The same for every conversation: what a deployment's system prompt is."""
    rng = random.Random(0)
    sentences = [words(rng, 15).capitalize() + "." for _ in range(max(1, n_words // 15))]
    return "You are the assistant of a small seaside town. " + " ".join(sentences)


@dataclass(frozen=True)
class Sizes:
    """Token targets turned into words for the served model's tokenizer."""

    system: str
    user_words: tuple[int, int]
    document_words: int  # the conversation's own document in its first message (0: none)


def sizes(url: str, key: str, args: argparse.Namespace) -> Sizes:
    """Measure tokens per word with the daemon's ``/tokenize`` and size the prompts by it."""
    probe = system_prompt(args.system_tokens)
    req = {"prompt": probe, "add_special_tokens": False}
    status, body = http_post(url + "/tokenize", req, key)
    if status != 200:
        raise RuntimeError(f"/tokenize answered {status}: {body[:300]!r}")
    per_word = orjson.loads(body)["count"] / len(probe.split())
    lo, hi = args.user_tokens
    return Sizes(
        system_prompt(round(args.system_tokens / per_word)),
        (max(1, round(lo / per_word)), max(1, round(hi / per_word))),
        round(args.document_tokens / per_word),
    )


# ---- the client ----


async def chat(
    session: aiohttp.ClientSession, url: str, messages: list[dict[str, str]], max_tokens: int,
    headers: dict[str, str] | None = None,
) -> tuple[float, str, dict[str, Any], str]:  # fmt: skip
    """One streamed chat: (TTFT, answer, usage, the decode PoP)."""
    body = {
        "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    sent = time.perf_counter()
    ttft, parts, usage = float("nan"), [], {}
    async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        pop = resp.headers.get("x-edge-decode-pop", "")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: {"):
                continue
            chunk = orjson.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if text := content_of(chunk):
                if not parts:
                    ttft = time.perf_counter() - sent
                parts.append(text)
            usage = chunk.get("usage") or usage
    return ttft, "".join(parts), usage, pop


@dataclass
class Conversation:
    number: int
    messages: list[dict[str, str]]
    rng: random.Random
    turns: int = 0  # asked so far
    history: int = 0  # tokens: the last turn's prompt and answer


async def next_turn(
    session: aiohttp.ClientSession, url: str, conv: Conversation, size: Sizes, max_tokens: int
) -> Turn:
    conv.turns += 1
    i, t = conv.number, conv.turns
    ask = f"Conversation {i}, question {t}: " + words(conv.rng, conv.rng.randint(*size.user_words))
    if t == 1 and size.document_words:
        ask = f"Read this document: {words(conv.rng, size.document_words)}.\n\n{ask}"
    conv.messages.append({"role": "user", "content": ask + "?"})
    ttft, answer, usage, pop = await chat(session, url, conv.messages, max_tokens)
    prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    turn = Turn(i, t, ttft, prompt, cached, completion, conv.history, pop)
    conv.history = prompt + completion
    conv.messages.append({"role": "assistant", "content": answer})
    return turn


async def run_workload(url: str, size: Sizes, args: argparse.Namespace) -> list[Turn]:
    """Every conversation's turns, ``concurrency`` requests at a time. A conversation's next
    turn joins the back of the queue when its answer is in (its user reads it and types while
    other users' turns run), so turns of different conversations interleave: the daemon that
    served a conversation's last turn is not simply the one that just fell idle."""
    queue: asyncio.Queue[Conversation | None] = asyncio.Queue()
    for i in range(args.conversations):
        system = {"role": "system", "content": size.system}
        queue.put_nowait(Conversation(i, [system], random.Random(1000 + i)))
    turns: list[Turn] = []
    left = args.conversations * args.turns

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal left
        while (conv := await queue.get()) is not None:
            turns.append(await next_turn(session, url, conv, size, args.max_tokens))
            left -= 1
            if conv.turns < args.turns:
                queue.put_nowait(conv)
            elif left == 0:
                for _ in range(args.concurrency):
                    queue.put_nowait(None)

    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(worker(session) for _ in range(args.concurrency)))
    return turns


async def warm_up(net: Network, size: Sizes, args: argparse.Namespace, aware: bool) -> None:
    """Each daemon pays its first-call costs on a prompt the workload never sends; the aware
    router fetches the daemons' tokenizer (it asks on its first request)."""
    rng = random.Random(99)
    auth = {"Authorization": f"Bearer {args.daemon_key}"}
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for daemon in net.daemons:
            ask = [{"role": "user", "content": words(rng, len(size.system.split()))}]
            await chat(session, daemon.url, ask, 4, auth)
        deadline = time.monotonic() + 60
        while aware and metric(net.router.url, "edgeinfer_router_prefix_blocks_asked_total") == 0:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the router never fetched the tokenizer:\n{net.router.output()}"
                )
            await chat(session, net.router.url, [{"role": "user", "content": "Hello."}], 1)
            await asyncio.sleep(0.2)


# ---- figures ----


def p50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarise(turns: list[Turn]) -> dict[str, Any]:
    first = [t for t in turns if t.turn == 1]
    later = [t for t in turns if t.turn > 1]
    per_pop = Counter(t.pop for t in turns)
    counts = [per_pop.get(pop, 0) for pop, _, _ in POPS]
    mean = sum(counts) / len(counts)
    return {
        "requests": len(turns),
        "ttft_p50_turn1_s": p50([t.ttft_s for t in first]),
        "ttft_p50_later_s": p50([t.ttft_s for t in later]),
        "ttft_p50_by_turn_s": {
            str(n): p50([t.ttft_s for t in turns if t.turn == n])
            for n in sorted({t.turn for t in turns})
        },
        # Over all later turns together (a ratio of sums), and the worst single turn.
        "cached_over_history": sum(t.cached_tokens for t in later)
        / max(1, sum(t.history_tokens for t in later)),
        "cached_over_history_min": min(
            (t.cached_tokens / t.history_tokens for t in later), default=float("nan")
        ),
        "cached_over_prompt": sum(t.cached_tokens for t in later)
        / max(1, sum(t.prompt_tokens for t in later)),
        "prompt_tokens_p50_later": p50([float(t.prompt_tokens) for t in later]),
        "requests_per_daemon": dict(zip([p for p, _, _ in POPS], counts, strict=True)),
        "max_over_mean": max(counts) / mean if mean else float("nan"),
        "uncached_p50_later": p50([float(t.prompt_tokens - t.cached_tokens) for t in later]),
        "turns": [asdict(t) for t in turns],
    }


def line(setup: str, s: dict[str, Any]) -> str:
    by_turn = ", ".join(f"{v * 1e3:.0f}" for v in s["ttft_p50_by_turn_s"].values())
    return (
        f"{setup:>5}: TTFT p50 turn 1 {s['ttft_p50_turn1_s'] * 1e3:6.0f} ms, turns 2+ "
        f"{s['ttft_p50_later_s'] * 1e3:6.0f} ms (by turn {by_turn}); uncached p50 turns 2+ "
        f"{s['uncached_p50_later']:.0f} tokens; cached / history {s['cached_over_history']:.0%} "
        f"(worst turn {s['cached_over_history_min']:.0%}), cached / prompt "
        f"{s['cached_over_prompt']:.0%}; requests per daemon {s['requests_per_daemon']} "
        f"max/mean {s['max_over_mean']:.2f}"
        + (f"; router tokens cached {c:.0%}" if (c := s.get("router_tokens_cached")) else "")
    )


def run_setup(args: argparse.Namespace, setup: str) -> dict[str, Any]:
    """The workload once on fresh processes: its summary."""
    with network(args, setup) as net:
        size = sizes(net.daemons[0].url, args.daemon_key, args)
        asyncio.run(warm_up(net, size, args, setup == "aware"))
        before = {n: metric(net.router.url, n) for n in TOKENIZE_METRICS}
        started = time.monotonic()
        turns = asyncio.run(run_workload(net.router.url, size, args))
        wall = time.monotonic() - started
        tokens, cached = (metric(net.router.url, n) - before[n] for n in TOKENIZE_METRICS)
    # What the router's piece cache gave of the prompt tokens it computed (aware setup only).
    router = {"router_tokens": tokens, "router_tokens_cached": cached / tokens if tokens else None}
    return summarise(turns) | router | {"wall_s": wall, "load_average_after": os.getloadavg()}


def host() -> dict[str, Any]:
    flags = subprocess.run(
        ["grep", "-o", "-w", r"avx512f\|avx512_bf16\|amx_tile\|avx2", "/proc/cpuinfo"],
        capture_output=True, text=True, check=False,
    ).stdout.split()  # fmt: skip
    model = next(
        (ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
         if ln.startswith("model name")), platform.processor(),
    )  # fmt: skip
    return {
        "host": platform.node(),
        "cpu": model,
        "cpu_flags": sorted(set(flags)),
        "cores": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help='"default" (SmolLM2-135M), "tiny" '
                        "or a checkpoint directory")  # fmt: skip
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--concurrency", type=int, default=3, help="conversations at a time")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=1000, help="about; shared by all")
    parser.add_argument(
        "--user-tokens", type=int, nargs=2, default=(50, 100), metavar=("MIN", "MAX"),
        help="about, per user message",
    )  # fmt: skip
    parser.add_argument(
        "--document-tokens", type=int, default=0,
        help="about; a document of its own in each conversation's first message (RAG, agents)",
    )  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=32, help="per answer")
    parser.add_argument("--kv-cache-mib", type=int, default=1024, help="per daemon: room for "
                        "every conversation, so the setups differ in placement, not eviction")  # fmt: skip
    parser.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    parser.add_argument("--rounds", type=int, default=2, help="each setup once per round")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    args.daemon_key, args.admin_token = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    info = host()
    print(f"host {info['host']}: {info['cpu']}, {info['cores']} cores, flags {info['cpu_flags']}")
    result: dict[str, Any] = {
        **info,
        "model": args.model,
        "workload": {k: v for k, v in vars(args).items() if k not in (
            "daemon_key", "admin_token", "out", "setups")},
        "load_average_start": os.getloadavg(),
        "rounds": [],
    }  # fmt: skip
    # The setups alternate, round after round: on a shared machine the neighbours' load
    # changes over minutes, and would otherwise favour whichever setup ran in a quiet spell.
    for r in range(args.rounds):
        summaries = {}
        for setup in args.setups:
            summaries[setup] = run_setup(args, setup)
            load = summaries[setup]["load_average_after"][0]
            print(f"round {r + 1}", line(setup, summaries[setup]), f"(load average {load:.1f})")
        if set(SETUPS) <= summaries.keys():
            ratio = summaries["blind"]["ttft_p50_later_s"] / summaries["aware"]["ttft_p50_later_s"]
            summaries["ttft_later_blind_over_aware"] = ratio
            print(f"round {r + 1} TTFT p50 turns 2+ blind / aware: {ratio:.2f}x")
        result["rounds"].append(summaries)
    pooled = {
        setup: summarise([Turn(**t) for rnd in result["rounds"] for t in rnd[setup]["turns"]])
        for setup in args.setups
    }
    for summary in pooled.values():
        del summary["turns"]  # each round has its own
    result["pooled"] = pooled
    print(f"all {args.rounds} round(s) together:")
    for setup, summary in pooled.items():
        print(line(setup, summary))
    if set(SETUPS) <= pooled.keys():
        blind, aware = pooled["blind"], pooled["aware"]
        ratio = blind["ttft_p50_later_s"] / aware["ttft_p50_later_s"]
        result["ttft_later_blind_over_aware"] = ratio
        worst = max(rnd["aware"]["max_over_mean"] for rnd in result["rounds"])
        print(
            f"TTFT p50 turns 2+ blind / aware: {ratio:.2f}x (target >= 2x); cached / history "
            f"(aware) {aware['cached_over_history']:.0%} (target >= 80%); requests max/mean "
            f"(aware, worst round) {worst:.2f} (target <= 1.25)"
        )
    print(f"load average (1, 5, 15 min) at the end: {os.getloadavg()} (a shared machine)")
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
