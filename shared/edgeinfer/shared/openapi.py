"""The OpenAPI 3.1 document of edgeinfer's public API, served at ``/openapi.json``.

One document serves a daemon and the router: the router proxies the daemon's OpenAI API
unchanged and adds only its own refusals (401/403/429/502/504) and headers (``X-Request-Id``,
``x-ratelimit-*``). A prefill daemon serves no OpenAI API and so no document. ``servers`` is
left out: paths are relative to wherever the document was fetched from. The bearer key is
optional in the document because keys are an operator's choice (the router's ``api_keys_file``,
a daemon's ``api_key``); where configured, a request without one gets a 401.
"""

from __future__ import annotations

import functools
from importlib.metadata import version
from typing import Any

import orjson
from aiohttp import web

from edgeinfer.shared.openapi_schemas import COMPONENT_SCHEMAS, Schema, ref

OPENAPI_PATH = "/openapi.json"

_JSON = "application/json"
_SSE = "text/event-stream"

_HEADERS: dict[str, Schema] = {
    "X-Request-Id": {
        "description": "The request's id, on every answer: the client's X-Request-Id when "
        "valid (1-128 of [A-Za-z0-9._:-]), else a new one; in both processes' log lines.",
        "required": True,
        "schema": {"type": "string", "pattern": "^[A-Za-z0-9._:-]{1,128}$"},
    },
    "Retry-After": {
        "description": "Seconds to wait before retrying.",
        "schema": {"type": "integer", "minimum": 0},
    },
}
# The router's, on every /v1 answer when the caller's key has limits (OpenAI's names).
for _unit in ("requests", "tokens"):
    _HEADERS |= {
        f"x-ratelimit-limit-{_unit}": {
            "description": f"The key's {_unit} per minute (router only).",
            "schema": {"type": "integer", "minimum": 0},
        },
        f"x-ratelimit-remaining-{_unit}": {
            "description": f"{_unit.capitalize()} left in the current window (router only).",
            "schema": {"type": "integer", "minimum": 0},
        },
        f"x-ratelimit-reset-{_unit}": {
            "description": "Until the whole limit is free again: '120ms', '17.5s', '6m0s' "
            "(router only).",
            "schema": {"type": "string", "pattern": r"^([0-9]+ms|([0-9]+m)?[0-9]+(\.[0-9]+)?s)$"},
        },
    }

_ERRORS = {
    400: "Invalid request: the error names the field (param) and, where OpenAI has one, the "
    "code (context_length_exceeded, untrusted_prefill_endpoint).",
    401: "Missing or unknown API key (invalid_api_key), where keys are configured.",
    403: "The key may not use this model.",
    404: "Unknown model (model_not_found) or route.",
    413: "The body is larger than the limit (16 MiB by default).",
    429: "Rate limit exceeded (rate_limit_exceeded): see Retry-After and x-ratelimit-*.",
    500: "Internal error; during a stream it arrives as an error event instead.",
    502: "The router's upstream daemon failed before answering.",
    503: "Loading, draining or no capacity: retry later.",
    504: "The router's whole-request time limit ran out.",
}


def _header_refs(*names: str) -> dict[str, Any]:
    return {n: {"$ref": f"#/components/headers/{n}"} for n in names}


_LIMIT_HEADERS = tuple(n for n in _HEADERS if n.startswith("x-ratelimit-"))


def _error(status: int) -> dict[str, Any]:
    names = ["X-Request-Id", *_LIMIT_HEADERS]
    if status in (429, 503):
        names.append("Retry-After")
    return {
        "description": _ERRORS[status],
        "headers": _header_refs(*names),
        "content": {_JSON: {"schema": ref("Error")}},
    }


def _sse_events(chunk: str) -> Schema:
    """Each server-sent event (OpenAPI 3.1 reading): its data is a JSON chunk, an error object
    after which the stream ends, or the final ``[DONE]``."""
    payload = {"anyOf": [ref(chunk), ref("Error")]}
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "type": "string",
                "if": {"const": "[DONE]"},
                "else": {"contentMediaType": _JSON, "contentSchema": payload},
            }
        },
    }


def _generate(summary: str, request: str, response: str, chunk: str) -> dict[str, Any]:
    return {
        "summary": summary,
        "operationId": summary.replace(" ", "_").lower(),
        "parameters": [
            {
                "name": "X-Request-Id",
                "in": "header",
                "required": False,
                "description": "Tags the request in logs; an invalid one is replaced.",
                "schema": {"type": "string"},
            },
        ],
        "requestBody": {"required": True, "content": {_JSON: {"schema": ref(request)}}},
        "responses": {
            "200": {
                "description": "The answer: JSON, or server-sent events when stream is true.",
                "headers": _header_refs("X-Request-Id", *_LIMIT_HEADERS),
                "content": {_JSON: {"schema": ref(response)}, _SSE: {"schema": _sse_events(chunk)}},
            },
            **{str(s): _error(s) for s in _ERRORS},
        },
    }


def _tokenizer_op(summary: str, request: str, response: str) -> dict[str, Any]:
    """``/tokenize`` and ``/detokenize``: vLLM's, keyed like ``/v1/*``."""
    return {
        "post": {
            "summary": summary,
            "operationId": summary.replace(" ", "_").lower(),
            "requestBody": {"required": True, "content": {_JSON: {"schema": ref(request)}}},
            "responses": {
                "200": {
                    "description": "OK",
                    "headers": _header_refs("X-Request-Id", *_LIMIT_HEADERS),
                    "content": {_JSON: {"schema": ref(response)}},
                },
                **{str(s): _error(s) for s in _ERRORS if s != 500},
            },
        }
    }


@functools.cache
def openapi_document() -> dict[str, Any]:
    """The document (built once; callers must not mutate it: copy it first)."""
    json_ok = {"description": "OK", "headers": _header_refs("X-Request-Id")}
    models_errors = (401, 429, 500, 502, 503, 504)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "edgeinfer",
            "version": version("edgeinfer"),
            "description": "OpenAI-compatible completions served from edge PoPs; the same API "
            "on a daemon (role both or decode) and on the router in front of them.",
        },
        "security": [{}, {"bearer": []}],
        "paths": {
            "/v1/completions": {
                "post": _generate(
                    "Create completion", "CompletionRequest", "Completion", "CompletionChunk"
                )
            },
            "/v1/chat/completions": {
                "post": _generate(
                    "Create chat completion",
                    "ChatCompletionRequest",
                    "ChatCompletion",
                    "ChatCompletionChunk",
                )
            },
            "/tokenize": _tokenizer_op("Tokenize", "TokenizeRequest", "TokenizeResponse"),
            "/detokenize": _tokenizer_op("Detokenize", "DetokenizeRequest", "DetokenizeResponse"),
            "/v1/models": {
                "get": {
                    "summary": "List models",
                    "operationId": "list_models",
                    "description": "A daemon: its model. The router: every model a daemon it "
                    "can place on serves.",
                    "responses": {
                        "200": {**json_ok, "content": {_JSON: {"schema": ref("ModelList")}}},
                        **{str(s): _error(s) for s in models_errors},
                    },
                }
            },
            "/health": {
                "get": {
                    "summary": "Health",
                    "operationId": "health",
                    "security": [{}],
                    "responses": {
                        "200": {**json_ok, "content": {_JSON: {"schema": ref("Health")}}},
                        "503": {
                            "description": "Not serving: a daemon loading, draining or failed "
                            "(its status), or a router with no daemon to place on (an error).",
                            "headers": _header_refs("X-Request-Id"),
                            "content": {
                                _JSON: {"schema": {"anyOf": [ref("Health"), ref("Error")]}}
                            },
                        },
                    },
                }
            },
            OPENAPI_PATH: {
                "get": {
                    "summary": "This document",
                    "operationId": "openapi",
                    "security": [{}],
                    "responses": {"200": {**json_ok, "content": {_JSON: {}}}},
                }
            },
        },
        "components": {
            "schemas": COMPONENT_SCHEMAS,
            "headers": _HEADERS,
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "An API key (`Authorization: Bearer KEY`), where configured.",
                }
            },
        },
    }


def add_openapi_route(app: web.Application) -> None:
    """Serve the document at ``/openapi.json`` (public, like ``/health``)."""
    body = orjson.dumps(openapi_document())

    async def serve(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type=_JSON)

    app.router.add_get(OPENAPI_PATH, serve)
