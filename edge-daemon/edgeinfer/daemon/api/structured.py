"""The output constraint a request asks for, from any of the fields clients use for it.

* OpenAI: ``response_format`` ``{"type": "text" | "json_object" | "json_schema"}``;
* vLLM: ``structured_outputs`` ``{json | regex | choice | grammar | json_object}``;
* vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``.

All endpoints accept all of them (vLLM does too). At most one constraint per request; two
are a 400, and so is any option that would change what is generated but is not supported
here (it is never silently dropped). Grammars are Lark or GBNF/EBNF (llama.cpp's), as the
grammar engine (llguidance) reads them.
"""

from __future__ import annotations

from typing import Any

from edgeinfer.daemon.api.errors import APIError
from edgeinfer.daemon.api.tokenize_pool import TokenizePool
from edgeinfer.daemon.engine.errors import InvalidRequestError
from edgeinfer.daemon.engine.structured import GrammarCompiler, StructuredSpec

_SO = "structured_outputs"
# vLLM options that change nothing here: no fallback engine, whitespace is never free, and
# the backend is always llguidance.
_SO_HARMLESS = frozenset({"disable_fallback", "disable_any_whitespace", "_backend", "backend"})
_SO_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_LEGACY = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def parse_structured(body: dict[str, Any]) -> StructuredSpec | None:
    """The request's constraint, or None; a 400 naming the field for anything malformed,
    contradictory or unsupported."""
    found: list[StructuredSpec] = []
    try:
        fmt = _response_format(body.get("response_format"))
        if fmt is not None:
            found.append(fmt)
        found.extend(_structured_outputs(body.get(_SO)))
        for field, kind in _LEGACY.items():
            if body.get(field) is not None:
                found.append(_spec(kind, body[field], field))
    except InvalidRequestError as exc:
        raise APIError.invalid(exc) from exc
    pattern = body.get("guided_whitespace_pattern")
    if pattern is not None:
        raise APIError(
            400, "guided_whitespace_pattern is not supported", param="guided_whitespace_pattern"
        )
    if len(found) > 1:
        names = ", ".join(s.param for s in found)
        raise APIError(400, f"only one output constraint is allowed, got {names}", param=names)
    return found[0] if found else None


async def compile_constraint(
    pool: TokenizePool, grammars: GrammarCompiler, spec: StructuredSpec
) -> None:
    """Compile ``spec`` on the request-parsing pool, off the event loop, so the engine finds
    it cached; a grammar error is a 400."""
    if grammars.is_cached(spec):
        return
    try:
        await pool.run(grammars.compile, spec)
    except InvalidRequestError as exc:
        raise APIError.invalid(exc) from exc


def _spec(kind: str, value: Any, param: str) -> StructuredSpec:
    if kind == "json":
        return StructuredSpec.json_schema(value, param)
    if kind == "choice":
        return StructuredSpec.choice(value, param)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{param} must be a non-empty string", param=param)
    return StructuredSpec(kind, value, param)


def _response_format(fmt: Any) -> StructuredSpec | None:
    param = "response_format"
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise InvalidRequestError(f"{param} must be an object", param=param)
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredSpec("json_object", "", param)
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        if not isinstance(inner, dict):
            raise InvalidRequestError(
                f"{param}.json_schema must be an object", param=f"{param}.json_schema"
            )
        schema_param = f"{param}.json_schema.schema"
        schema = inner.get("schema")
        if schema is None:
            # OpenAI allows leaving the schema out: then any JSON object is fine.
            return StructuredSpec("json_object", "", schema_param)
        return StructuredSpec.json_schema(schema, schema_param)
    raise InvalidRequestError(
        f"{param}.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        param=f"{param}.type",
    )


def _structured_outputs(so: Any) -> list[StructuredSpec]:
    if so is None:
        return []
    if not isinstance(so, dict):
        raise InvalidRequestError(f"{_SO} must be an object", param=_SO)
    unknown = sorted(set(so) - _SO_HARMLESS - set(_SO_KINDS) - {"_backend_was_auto"})
    set_unsupported = [k for k in unknown if so[k] not in (None, False)]
    if set_unsupported:
        names = ", ".join(f"{_SO}.{k}" for k in set_unsupported)
        raise InvalidRequestError(f"{names} not supported", param=f"{_SO}.{set_unsupported[0]}")
    specs = []
    for kind in _SO_KINDS:
        value = so.get(kind)
        if value is None or (kind == "json_object" and value is False):
            continue
        param = f"{_SO}.{kind}"
        if kind == "json_object":
            if value is not True:
                raise InvalidRequestError(f"{param} must be a boolean", param=param)
            specs.append(StructuredSpec("json_object", "", param))
        else:
            specs.append(_spec(kind, value, param))
    return specs
