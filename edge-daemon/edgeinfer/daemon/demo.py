"""`make demo`: the engine answers a batch of chat questions on the built-in model.

All questions are submitted at once (continuous batching mixes them); the first answer is
streamed to the terminal as it is generated, the others are printed when they finish, and
a throughput line closes the run.
"""

from __future__ import annotations

import argparse
import sys
import time

from edgeinfer.daemon.engine.config import EngineConfig
from edgeinfer.daemon.engine.llm_engine import LLMEngine
from edgeinfer.daemon.engine.sampling_params import SamplingParams

QUESTIONS = (
    "What is the capital of France?",
    "Name three primary colours.",
    "What does a CDN do, in one sentence?",
    "Give me a synonym for 'fast'.",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="directory, 'tiny', or the built-in model")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=args.model))
    print(f"loaded {engine.model_dir.name} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    texts: dict[str, str] = {}
    for i, question in enumerate(QUESTIONS):
        prompt = engine.encode_chat([{"role": "user", "content": question}])
        engine.add_request(f"q{i}", prompt, params)
        texts[f"q{i}"] = ""

    print(f"Q: {QUESTIONS[0]}\nA: ", end="", flush=True)
    start, tokens = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += len(out.new_token_ids)
            texts[out.request_id] += out.new_text
            if out.request_id == "q0":
                print(out.new_text, end="", flush=True)
    elapsed = time.perf_counter() - start
    print()
    for i, question in enumerate(QUESTIONS[1:], start=1):
        print(f"Q: {question}\nA: {texts[f'q{i}'].strip()}")
    print(
        f"{len(QUESTIONS)} requests, {tokens} output tokens in {elapsed:.2f}s: {tokens / elapsed:.1f} tok/s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
