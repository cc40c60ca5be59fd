"""Loglikelihood benchmark (not a timed test): does ``/v1/completions`` score text exactly as
transformers does?

Evaluation harnesses (lm-evaluation-harness's ``local-completions``) rank multiple-choice answers
by the log-probability of each (context, continuation) pair, asked as
``{"prompt": ctx + cont token ids, "max_tokens": 0, "echo": true, "logprobs": 1,
"temperature": 0}``: the answer's ``token_logprobs`` past the context are the continuation's.
This script builds ``--pairs`` such pairs (questions of 4 answers each, from a fixed word list
and seed), scores them through a float32 daemon (a real process on free ports) and through
transformers' forward pass over the same checkpoint, and reports the largest difference of a
token's log-prob (target <= 1e-4) and whether every question picks the same answer.

Prints a summary and writes ``bench/results/loglikelihood[-MODEL].json``.

    .venv/bin/python bench/loglikelihood.py                     # tiny model, 200 pairs
    .venv/bin/python bench/loglikelihood.py --model default     # the built-in SmolLM2
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from edgeinfer.daemon.engine.default_model import resolve_model
from edgeinfer.daemon.engine.tokenizer import Tokenizer
from edgeinfer.shared.processes import ChildProcess, free_port, spawn

RESULTS = Path(__file__).parent / "results"
CHOICES = 4
TARGET = 1e-4
WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "while",
    "the",
    "dog",
    "ran",
    "to",
    "the",
    "park",
    "and",
    "a",
    "bird",
    "sang",
    "in",
    "the",
    "old",
    "tree",
    "near",
    "river",
    "where",
    "children",
    "play",
    "every",
    "summer",
    "day",
    "because",
    "sun",
    "is",
    "warm",
    "and",
    "water",
    "cool",
    "but",
    "winter",
    "brings",
    "snow",
    "ice",
    "wind",
    "so",
    "people",
    "stay",
    "home",
    "read",
    "books",
    "cook",
    "soup",
    "talk",
    "about",
    "plans",
    "for",
    "spring",
]


@dataclass
class Question:
    context: list[int]
    answers: list[list[int]]


def make_questions(tokenizer: Tokenizer, pairs: int, seed: int = 0) -> list[Question]:
    """``pairs // 4`` questions: a context of 8-40 words and 4 answers of 1-6 words, tokenised
    apart as harnesses do (the context with BOS, the answers with a leading space, no BOS)."""
    rng = random.Random(seed)
    questions = []
    for _ in range(pairs // CHOICES):
        context = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40)))
        answers = [
            " " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))
            for _ in range(CHOICES)
        ]
        questions.append(
            Question(
                tokenizer.encode(context),
                [tokenizer.encode(a, add_special_tokens=False) for a in answers],
            )
        )
    return questions


def score_api(url: str, questions: list[Question]) -> list[list[list[float]]]:
    """Per question, per answer: the continuation tokens' log-probs, from the daemon."""
    out = []
    for q in questions:
        per_answer = []
        for answer in q.answers:
            body = {"prompt": q.context + answer, "max_tokens": 0, "echo": True, "logprobs": 1,
                    "temperature": 0}  # fmt: skip
            req = urllib.request.Request(
                url + "/v1/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=300) as resp:
                choice = json.loads(resp.read())["choices"][0]
            per_answer.append(choice["logprobs"]["token_logprobs"][len(q.context) :])
        out.append(per_answer)
    return out


@torch.inference_mode()
def score_hf(model_dir: Path, questions: list[Question]) -> list[list[list[float]]]:
    """The same log-probs from transformers' forward pass in float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for q in questions:
        per_answer = []
        for answer in q.answers:
            ids = torch.tensor([q.context + answer])
            logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
            targets = ids[0, len(q.context) :]
            rows = logprobs[len(q.context) - 1 : -1]
            per_answer.append(rows.gather(1, targets.unsqueeze(1)).squeeze(1).tolist())
        out.append(per_answer)
    return out


def compare(api: list[list[list[float]]], hf: list[list[list[float]]]) -> dict[str, Any]:
    diffs = [
        abs(a - b)
        for qa, qh in zip(api, hf, strict=True)
        for aa, ah in zip(qa, qh, strict=True)
        for a, b in zip(aa, ah, strict=True)
    ]
    picks_api = [max(range(CHOICES), key=lambda i, q=q: sum(q[i])) for q in api]
    picks_hf = [max(range(CHOICES), key=lambda i, q=q: sum(q[i])) for q in hf]
    return {
        "tokens_scored": len(diffs),
        "max_abs_diff": max(diffs),
        "mean_abs_diff": sum(diffs) / len(diffs),
        "same_ranking": picks_api == picks_hf,
        "questions": len(api),
    }


def start_daemon(model: str, workdir: Path) -> ChildProcess:
    port = free_port()
    cmd = [
        sys.executable, "-m", "edgeinfer.daemon.main", "--model", model, "--dtype", "float32",
        "--host", "127.0.0.1", "--port", str(port), "--kv-port", str(free_port()),
        "--log-level", "warning",
    ]  # fmt: skip
    env = {"EDGEINFER_HEARTBEAT_PORT": str(free_port())}
    return spawn("daemon", cmd, workdir=workdir, url=f"http://127.0.0.1:{port}", env=env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help='"tiny", "default" or a directory')
    parser.add_argument("--pairs", type=int, default=200, help="(context, continuation) pairs")
    args = parser.parse_args()
    spec = None if args.model == "default" else args.model
    model_dir = resolve_model(spec)
    questions = make_questions(Tokenizer.from_dir(model_dir), args.pairs)
    proc = start_daemon(str(model_dir), Path(tempfile.mkdtemp(prefix="loglik-")))
    try:
        proc.wait_http("/health", 600)
        start = time.perf_counter()
        api = score_api(proc.url, questions)
        api_s = time.perf_counter() - start
    finally:
        proc.stop()
    hf = score_hf(model_dir, questions)
    result = compare(api, hf) | {
        "model": args.model,
        "pairs": len(questions) * CHOICES,
        "api_seconds": api_s,
        "host": platform.node(),
        "python": platform.python_version(),
    }
    ok = result["max_abs_diff"] <= TARGET and result["same_ranking"]
    print(
        f"{result['pairs']} pairs ({result['tokens_scored']} continuation tokens) on "
        f"{args.model}: max |daemon - transformers| = {result['max_abs_diff']:.2e} "
        f"(target <= {TARGET:g}), mean {result['mean_abs_diff']:.2e}; same answer picked for "
        f"every question: {result['same_ranking']}; {api_s:.1f} s through the API "
        f"-> {'PASS' if ok else 'FAIL'}"
    )
    suffix = "" if args.model == "tiny" else f"-{Path(args.model).name}"
    path = RESULTS / f"loglikelihood{suffix}.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
