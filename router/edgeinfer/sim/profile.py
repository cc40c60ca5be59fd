"""The engine's step cost, from a measured profile (``bench/profile_engine.py`` writes it).

One engine step runs the decode tokens of its running batch plus up to
``max_num_batched_tokens`` of prompt chunks (chunked prefill), so its duration is modelled as

    fixed + decode.seq_s * batch + decode.context_token_s * context tokens of the batch
          + prefill.token_s * chunk tokens + prefill.attention_s * sum(chunk tokens x position)

with one fixed cost per step (the larger of the two fits': a mixed step launches once). The
coefficients are least-squares fits to measurements of the real engine, so the simulator runs in
O(1) per step instead of interpolating a table. ``gpu_like`` (default) is the measured shape
scaled to an 8B model on a GPU; ``measured`` is the CPU as measured (see the JSON's ``why``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Literal

from edgeinfer.sim import SimError

DEFAULT_PROFILE = Path(__file__).parent / "data" / "engine_profile.json"
ProfileKind = Literal["gpu_like", "measured"]


@dataclasses.dataclass(frozen=True, slots=True)
class EngineProfile:
    prefill_fixed_s: float
    prefill_token_s: float
    prefill_attention_s: float  # per token x position: attention over the prompt so far
    decode_fixed_s: float
    decode_seq_s: float
    decode_context_token_s: float
    kv_bytes_per_token: int
    max_num_batched_tokens: int
    source: str = "inline"

    def __post_init__(self) -> None:
        costs = dataclasses.astuple(self)[:6]
        if any(not c >= 0 for c in costs) or self.prefill_token_s + self.decode_seq_s <= 0:
            raise SimError(f"profile costs must be >= 0 and not all zero, got {costs}")
        if self.kv_bytes_per_token < 1 or self.max_num_batched_tokens < 1:
            raise SimError("profile kv_bytes_per_token and max_num_batched_tokens must be >= 1")

    def prefill_s(self, tokens: int, start: int = 0) -> float:
        """Compute time of ``tokens`` prompt tokens at positions ``start..`` (one chunk)."""
        attention = tokens * (start + tokens / 2)
        return self.prefill_token_s * tokens + self.prefill_attention_s * attention

    def decode_s(self, batch: int, context_tokens: int) -> float:
        return self.decode_seq_s * batch + self.decode_context_token_s * context_tokens

    def fixed_s(self, decoding: bool, prefilling: bool) -> float:
        return max(
            self.decode_fixed_s if decoding else 0.0, self.prefill_fixed_s if prefilling else 0.0
        )

    def prompt_s(self, tokens: int) -> float:
        """A whole prompt alone on an idle engine, chunk by chunk (for reports and tests)."""
        total, done, chunk = 0.0, 0, self.max_num_batched_tokens
        while done < tokens:
            n = min(chunk, tokens - done)
            total += self.prefill_fixed_s + self.prefill_s(n, done)
            done += n
        return total

    @classmethod
    def load(cls, path: Path | None = None, kind: ProfileKind = "gpu_like") -> EngineProfile:
        path = path or DEFAULT_PROFILE
        try:
            doc = json.loads(path.read_text())
            section = doc[kind]
            p, d = section["prefill"], section["decode"]
            return cls(
                prefill_fixed_s=float(p["fixed_s"]),
                prefill_token_s=float(p["token_s"]),
                prefill_attention_s=float(p["attention_s"]),
                decode_fixed_s=float(d["fixed_s"]),
                decode_seq_s=float(d["seq_s"]),
                decode_context_token_s=float(d["context_token_s"]),
                kv_bytes_per_token=int(section["kv_bytes_per_token"]),
                max_num_batched_tokens=int(section["max_num_batched_tokens"]),
                source=f"{path.name}:{kind}",
            )
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SimError(f"cannot read engine profile {path} ({kind}): {e}") from e
