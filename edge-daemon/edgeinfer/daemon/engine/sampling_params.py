"""Per-request decoding options, validated once when the request enters the engine."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from edgeinfer.daemon.engine.errors import InvalidRequestError
from edgeinfer.daemon.engine.structured.spec import StructuredSpec

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
# OpenAI's range for a logit_bias value; a bias of -100/100 bans/forces a token in practice.
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024
# Seeds travel through OpenAI clients as int64; torch generators accept that range.
_SEED_MIN = -(2**63)
_SEED_MAX = 2**63 - 1
# Below this, logits / temperature overflows float32 for ordinary logit ranges, so such
# temperatures decode greedily (vLLM uses the same cut-off).
GREEDY_TEMPERATURE = 1e-5


_FLOAT32_MAX = 3.4028234663852886e38


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
    # The sampler holds these in float32 tensors: a larger magnitude would overflow there and
    # fail the whole batch's step instead of this one request.
    if not math.isfinite(value) or abs(value) > _FLOAT32_MAX:
        raise _fail(param, f"must be a finite float32 number, got {value:g}")
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
    # vLLM's ``prompt_logprobs``: per prompt token its log-prob and the k most likely
    # alternatives (None: not asked). Such a request does not reuse prefix-cache blocks.
    prompt_logprobs: int | None = None
    # (token id, bias) pairs added to the logits before sampling (OpenAI's ``logit_bias``).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # The grammar the output must follow (response_format, structured_outputs, guided_*).
    structured: StructuredSpec | None = None

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
        if self.structured is not None:
            # The KV wire carries it as a plain map (dataclasses.asdict).
            put("structured", StructuredSpec.from_mapping(self.structured))

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
        if self.prompt_logprobs is not None:
            k = _as_int("prompt_logprobs", self.prompt_logprobs)
            if not 0 <= k <= MAX_LOGPROBS:
                raise _fail("prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {k}")
        put("logit_bias", self._check_logit_bias(self.logit_bias))

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
    def _check_logit_bias(bias: Any) -> tuple[tuple[int, float], ...]:
        """A map (or pairs) of token id -> bias; ids as ints or decimal strings."""
        if isinstance(bias, dict):
            bias = list(bias.items())
        if not isinstance(bias, list | tuple):
            raise _fail("logit_bias", f"must map token ids to numbers, got {type(bias).__name__}")
        pairs = list(bias)
        if len(pairs) > MAX_LOGIT_BIAS_ENTRIES:
            raise _fail("logit_bias", f"must hold at most {MAX_LOGIT_BIAS_ENTRIES} entries")
        out = []
        for pair in pairs:
            if not isinstance(pair, list | tuple) or len(pair) != 2:
                raise _fail("logit_bias", "must map token ids to numbers")
            key = pair[0]
            # JSON object keys are strings: OpenAI's logit_bias maps "token id" -> bias.
            if isinstance(key, str):
                try:
                    key = int(key)
                except ValueError:
                    raise _fail("logit_bias", f"keys must be token ids, got {key!r}") from None
            token_id = _as_int("logit_bias", key)
            value = _as_float("logit_bias", pair[1])
            if token_id < 0 or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise _fail(
                    "logit_bias",
                    f"needs token ids >= 0 and biases in [-100, 100], got {token_id}: {value:g}",
                )
            out.append((token_id, value))
        return tuple(out)

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
