"""Prefix-aware placement costs for ``bench/router.py``: tokenising and hashing a request as the
daemon will (per 1k prompt tokens, with the built-in model's tokenizer and chat template), and
placement decisions that carry prefix hits.

The tokenizer is the built-in model's (SmolLM2-135M-Instruct, ``edge-daemon`` downloads it into
the edgeinfer cache on first start); without it the tokenisation rows are skipped.
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
from pathlib import Path
from typing import Any

from edgeinfer.router.router_tokenizer import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    PromptText,
    RouterTokenizer,
)
from edgeinfer.shared.cache_dir import cache_dir

MODEL_DIR = cache_dir() / "models" / "smollm2-135m-instruct"
TEXT = (
    "The harbour master counted the boats at dawn, wrote their names in a ledger and walked "
    "along the quay to the bakery, where the first loaves were cooling on the racks. "
)
SIZES = (256, 1024, 4096, 16384)  # prompt tokens, roughly


def tokenizer_description(model_dir: Path, tokenizer_id: str) -> dict[str, Any] | None:
    """What a daemon's ``GET /v1/tokenizer`` would answer for ``model_dir`` (None: no
    tokenizer there)."""
    if not (model_dir / "tokenizer.json").is_file():
        return None
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    template = cfg.get("chat_template")
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()
    special = {k: v if isinstance(v, str) else v.get("content") for k in (
        "bos_token", "eos_token", "unk_token", "pad_token") if (v := cfg.get(k)) is not None}  # fmt: skip
    return {
        "tokenizer_id": tokenizer_id, "block_size": 16,
        "tokenizer_json": (model_dir / "tokenizer.json").read_text(),
        "chat_template": template, "special_tokens": special,
    }  # fmt: skip


def _time(fn: Any, repeat: int) -> float:
    """Median seconds of ``fn()`` over ``repeat`` calls (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_tokenize(quick: bool) -> dict[str, Any]:
    description = tokenizer_description(MODEL_DIR, "bench")
    if description is None:
        return {"skipped": f"no tokenizer at {MODEL_DIR} (start edge-daemon once to fetch it)"}
    tok = RouterTokenizer(description)
    out: dict[str, Any] = {"tokenizer": "SmolLM2-135M-Instruct", "block_size": 16}
    repeat = 5 if quick else 30
    for size in SIZES:
        text = TEXT * max(1, size // 30)
        chat = {"messages": [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": text}]}  # fmt: skip
        prompt = tok.prompt_text(CHAT_PATH, chat)
        assert prompt is not None
        ids = tok.encode(prompt)
        n = len(ids)
        render_s = _time(lambda: tok.prompt_text(CHAT_PATH, chat), repeat)  # noqa: B023
        # A new salt each call: no piece cached, the text encoded as the first time.
        salts = (f"s{i}" for i in itertools.count())
        encode_s = _time(lambda: tok.encode(prompt, salt=next(salts)), repeat)  # noqa: B023
        keys_s = _time(lambda: tok.block_keys(ids, "tenant"), repeat)  # noqa: B023
        # The same text as a shared system prompt, each request with its own question: what
        # the piece cache leaves to encode (the question and the template's few tokens).
        questions = (shared_prompt(tok, text, i) for i in itertools.count())
        shared_s = _time(lambda: tok.encode(next(questions), salt="t"), repeat)  # noqa: B023
        completion = tok.prompt_text(COMPLETIONS_PATH, {"prompt": text})
        assert completion is not None
        per_k = 1000 / n
        out[f"chat_{n}_tokens"] = {
            "render_us": round(render_s * 1e6, 1),
            "encode_us_per_1k_tokens": round(encode_s * 1e6 * per_k, 1),
            "block_keys_us_per_1k_tokens": round(keys_s * 1e6 * per_k, 1),
            "total_us_per_1k_tokens": round((render_s + encode_s + keys_s) * 1e6 * per_k, 1),
            "encode_us_shared_system_prompt": round(shared_s * 1e6, 1),
        }
    out["pieces_cached"] = tok.segments.segmenting
    return out


def shared_prompt(tok: RouterTokenizer, system: str, i: int) -> PromptText:
    """A chat whose system prompt is ``system`` and whose question is the ``i``-th."""
    chat = {"messages": [{"role": "system", "content": system},
                         {"role": "user", "content": f"Question {i}: when do the boats leave?"}]}  # fmt: skip
    prompt = tok.prompt_text(CHAT_PATH, chat)
    assert prompt is not None
    return prompt
