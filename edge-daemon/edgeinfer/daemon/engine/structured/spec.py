"""What a request constrains its output to: one grammar, named by kind and source text.

The spec is small, hashable and made of strings only, so it travels inside the sampling
parameters (and with them over the KV wire to a prefill daemon) and keys the compiled-grammar
cache. JSON sources are re-serialised without spaces, so equal schemas sent with different
spacing share one compiled grammar (key order stays: it is the order properties are written).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from edgeinfer.daemon.engine.errors import InvalidRequestError

Kind = Literal["json", "json_object", "regex", "choice", "grammar"]
KINDS: frozenset[str] = frozenset(get_args(Kind))
# Far above any real schema or grammar; bounds what one request can make the compiler chew.
MAX_SOURCE_CHARS = 1 << 20


@dataclass(frozen=True, slots=True)
class StructuredSpec:
    """``kind``: ``json`` (a JSON schema), ``json_object`` (any JSON object), ``regex``,
    ``choice`` (a JSON list of strings) or ``grammar`` (Lark or GBNF/EBNF text).
    ``param`` names the request field it came from, for error messages; not part of the key."""

    kind: str
    source: str
    param: str = "structured_outputs"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(
                f"unknown constraint kind {self.kind!r}; expected one of {sorted(KINDS)}",
                param=self.param,
            )
        if not isinstance(self.source, str) or len(self.source) > MAX_SOURCE_CHARS:
            raise InvalidRequestError(
                f"{self.param} must be a string of at most {MAX_SOURCE_CHARS} characters",
                param=self.param,
            )

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.source)

    @classmethod
    def json_schema(cls, schema: Any, param: str) -> StructuredSpec:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise InvalidRequestError(f"{param} is not valid JSON: {exc}", param=param) from exc
        if not isinstance(schema, dict | bool):
            raise InvalidRequestError(f"{param} must be a JSON schema object", param=param)
        return cls("json", _canonical(schema), param)

    @classmethod
    def choice(cls, options: Any, param: str) -> StructuredSpec:
        if (
            not isinstance(options, list)
            or not options
            or not all(isinstance(o, str) for o in options)
        ):
            raise InvalidRequestError(f"{param} must be a non-empty list of strings", param=param)
        return cls("choice", _canonical(options), param)

    @classmethod
    def from_mapping(cls, value: Any) -> StructuredSpec:
        """The spec back from :func:`dataclasses.asdict` (the KV wire's sampling map)."""
        if isinstance(value, StructuredSpec):
            return value
        if not isinstance(value, Mapping) or set(value) - {"kind", "source", "param"}:
            raise InvalidRequestError("structured must be a {kind, source} map", param="structured")
        kind, source = value.get("kind"), value.get("source")
        if not isinstance(kind, str) or not isinstance(source, str):
            raise InvalidRequestError("structured must be a {kind, source} map", param="structured")
        param = value.get("param", "structured_outputs")
        return cls(kind, source, param if isinstance(param, str) else "structured_outputs")


def _canonical(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
