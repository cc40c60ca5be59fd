"""Per-request decoding options, validated once when the request enters the engine."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from edgeinfer.daemon.engine.errors import InvalidRequestError

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
# Seeds travel through OpenAI clients as int64; torch generators accept that range.
_SEED_MIN = -(2**63)
_SEED_MAX = 2**63 - 1
# Below this, logits / temperature overflows float32 for ordinary logit ranges, so such
# temperatures decode greedily (vLLM uses the same cut-off).
GREEDY_TEMPERATURE = 1e-5


def _fail(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param} {message}", param=param)


def _as_int(param: str, value: Any) -> int:
    # bool is a subclass of int; `max_tokens=True` is a client bug, not the number 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(param, f"must be an integer, got {type(value).__name__}")
    return value


def _as_float(param: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _fail(param, f"must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise _fail(param, f"must be finite, got {value}")
    return value


def _as_bool(param: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _fail(param, f"must be a boolean, got {type(value).__name__}")
    return value


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` (in fact anything < 1e-5) means greedy decoding; ``top_k`` of 0 or -1 disables top-k.
    ``repetition_penalty`` follows HF/vLLM (over prompt and output tokens, positive logits
    divided, negative multiplied); ``presence_penalty``/``frequency_penalty`` follow OpenAI
    (over output tokens only). ``logprobs`` is the number of top alternatives returned per
    generated token (None: no logprobs at all, 0: only the chosen token's log-prob).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Frozen dataclass: normalised values (int -> float, list -> tuple) go in via
        # object.__setattr__, which is the documented escape hatch for __post_init__.
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        put("max_tokens", _as_int("max_tokens", self.max_tokens))
        if self.max_tokens < 1:
            raise _fail("max_tokens", f"must be >= 1, got {self.max_tokens}")

        put("temperature", _as_float("temperature", self.temperature))
        if self.temperature < 0:
            raise _fail("temperature", f"must be >= 0, got {self.temperature:g}")

        put("top_k", _as_int("top_k", self.top_k))
        if self.top_k < -1:
            raise _fail("top_k", f"must be -1 or 0 (disabled) or >= 1, got {self.top_k}")

        put("top_p", _as_float("top_p", self.top_p))
        if not 0.0 < self.top_p <= 1.0:
            raise _fail("top_p", f"must be in (0, 1], got {self.top_p:g}")

        put("min_p", _as_float("min_p", self.min_p))
        if not 0.0 <= self.min_p <= 1.0:
            raise _fail("min_p", f"must be in [0, 1], got {self.min_p:g}")

        if self.seed is not None:
            seed = _as_int("seed", self.seed)
            if not _SEED_MIN <= seed <= _SEED_MAX:
                raise _fail("seed", f"must be in [{_SEED_MIN}, {_SEED_MAX}], got {seed}")

        put("repetition_penalty", _as_float("repetition_penalty", self.repetition_penalty))
        if self.repetition_penalty <= 0:
            raise _fail("repetition_penalty", f"must be > 0, got {self.repetition_penalty:g}")

        for name in ("presence_penalty", "frequency_penalty"):
            value = _as_float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise _fail(name, f"must be in [-2, 2], got {value:g}")
            put(name, value)

        put("stop", self._check_stop(self.stop))
        put("stop_token_ids", self._check_stop_token_ids(self.stop_token_ids))

        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            _as_bool(name, getattr(self, name))

        put("min_tokens", _as_int("min_tokens", self.min_tokens))
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise _fail(
                "min_tokens",
                f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
            )

        if self.logprobs is not None:
            logprobs = _as_int("logprobs", self.logprobs)
            if not 0 <= logprobs <= MAX_LOGPROBS:
                raise _fail("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {logprobs}")

    @staticmethod
    def _check_stop(stop: Any) -> tuple[str, ...]:
        # OpenAI accepts a bare string as a single stop sequence.
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, list | tuple):
            raise _fail("stop", f"must be a string or a list of strings, got {type(stop).__name__}")
        if len(stop) > MAX_STOP_STRINGS:
            raise _fail("stop", f"must hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        for item in stop:
            if not isinstance(item, str):
                raise _fail("stop", f"must hold strings, got {type(item).__name__}")
            if not item:
                raise _fail("stop", "must not hold empty strings")
        return tuple(stop)

    @staticmethod
    def _check_stop_token_ids(ids: Any) -> tuple[int, ...]:
        if not isinstance(ids, list | tuple):
            raise _fail("stop_token_ids", f"must be a list of integers, got {type(ids).__name__}")
        for token_id in ids:
            if _as_int("stop_token_ids", token_id) < 0:
                raise _fail("stop_token_ids", f"must hold ids >= 0, got {token_id}")
        return tuple(ids)

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature 0, or below 1e-5, where dividing by it
        would overflow): no randomness, and top-k/top-p/min-p have no effect."""
        return self.temperature < GREEDY_TEMPERATURE

    @classmethod
    def greedy_params(cls, max_tokens: int = 16, **overrides: Any) -> SamplingParams:
        """Greedy decoding with the remaining options at their defaults (or ``overrides``)."""
        return cls(max_tokens=max_tokens, temperature=0.0, **overrides)
