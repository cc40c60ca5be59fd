"""The OpenAPI document: a valid OpenAPI 3.1 document, in step with the daemon's parser, matched
by the daemon's real answers, and served by the processes that serve the OpenAI API."""

from __future__ import annotations

import ast
import copy
import json
from pathlib import Path
from typing import Any

import jsonschema_rs
import pytest
import pytest_asyncio
import schemathesis
from schemathesis.core.result import Ok

from daemon_helpers import daemon_config, read_events, start
from edgeinfer.daemon.api import cache_salt, protocol
from edgeinfer.daemon.app import build_app
from edgeinfer.daemon.engine import sampling_params
from edgeinfer.daemon.engine.llm_engine import LLMEngine
from edgeinfer.router.app import RouterSetup, create_app
from edgeinfer.router.config import RouterConfig
from edgeinfer.router.pop_registry import PopConfig
from edgeinfer.shared import openapi_schemas
from edgeinfer.shared.openapi import OPENAPI_PATH, openapi_document

API_DIR = Path(protocol.__file__).parent
# kv_transfer_params.prefill_endpoint names infrastructure, which only the router may choose.
UNDOCUMENTED = {"kv_transfer_params", "prefill_endpoint"}


def _validator(name: str) -> jsonschema_rs.Validator:
    root = {"$ref": f"#/components/schemas/{name}", "components": openapi_document()["components"]}
    return jsonschema_rs.validator_for(root)


def _property_names(node: Any) -> set[str]:
    names: set[str] = set()
    if isinstance(node, dict):
        names |= set(node.get("properties", {}))
        for value in node.values():
            names |= _property_names(value)
    elif isinstance(node, list):
        for value in node:
            names |= _property_names(value)
    return names


def test_the_document_is_valid_openapi_3_1() -> None:
    schema = schemathesis.openapi.from_dict(copy.deepcopy(openapi_document()))
    schema.validate()  # against the OpenAPI 3.1 meta-schema
    labels = []
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), result
        labels.append(result.ok().label)
    assert labels == [
        "POST /v1/completions",
        "POST /v1/chat/completions",
        "POST /tokenize",
        "POST /detokenize",
        "GET /v1/models",
        "GET /health",
        "GET /openapi.json",
    ]


@pytest.mark.parametrize("name", sorted(openapi_schemas.COMPONENT_SCHEMAS))
def test_every_schema_is_valid_json_schema_with_resolvable_refs(name: str) -> None:
    jsonschema_rs.meta.validate(openapi_schemas.COMPONENT_SCHEMAS[name])
    _validator(name)  # compiling resolves every $ref


def _is_body(node: ast.expr) -> bool:
    """A request body or its typed view: ``body``, ``f``/``fields`` or ``Fields(...)``."""
    if isinstance(node, ast.Call):
        return isinstance(node.func, ast.Name) and node.func.id == "Fields"
    return isinstance(node, ast.Name) and node.id in {"body", "f", "fields"}


def test_every_field_the_daemon_reads_is_documented() -> None:
    """Guards against drift: a request field the parser reads (``f.flag("x")``,
    ``body.get("x")``...) that the document does not name fails here."""
    read: set[str] = set()
    for path in sorted(API_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in {"get", "text", "integer", "flag", "object"}
                and _is_body(node.func.value)
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                read.add(node.args[0].value)
    read |= set(protocol._SAMPLING_FIELDS)
    assert read - UNDOCUMENTED - _property_names(openapi_document()) == set()


def test_limits_match_the_daemons() -> None:
    assert openapi_schemas.MAX_STOP_STRINGS == sampling_params.MAX_STOP_STRINGS
    assert openapi_schemas.MAX_LOGPROBS == sampling_params.MAX_LOGPROBS
    assert openapi_schemas.MAX_CACHE_SALT_CHARS == cache_salt.MAX_CACHE_SALT_CHARS


def _paths(app: Any) -> set[str]:
    return {r.resource.canonical for r in app.router.routes() if r.resource is not None}


def test_served_where_the_api_is(tmp_path: Path) -> None:
    """A daemon with the API and the router serve the document; a prefill daemon has neither."""
    both = build_app(daemon_config(tmp_path, role="both"))
    prefill = build_app(daemon_config(tmp_path, role="prefill"))
    pop = PopConfig(name="lhr", lat=51.5, lon=-0.1, daemons=("http://127.0.0.1:1",))
    router = create_app(RouterSetup(RouterConfig(here="lhr"), (pop,), admin_token=None))
    assert OPENAPI_PATH in _paths(both) and "/v1/completions" in _paths(both)
    assert OPENAPI_PATH in _paths(router)
    assert OPENAPI_PATH not in _paths(prefill)


# ---- real answers of an in-process daemon match the document ----------------------------


@pytest_asyncio.fixture
async def client(aiohttp_client: Any, checkpoint: Path, llm: LLMEngine) -> Any:
    return await start(aiohttp_client, daemon_config(checkpoint), llm)


EXTRAS = {"max_tokens": 4, "return_token_ids": True, "stop": ["\n"], "seed": 1}
CASES = [
    ("/v1/completions", "Completion", "CompletionChunk", {"prompt": ["Hi", [1, 2]], "logprobs": 2}),
    (
        "/v1/chat/completions",
        "ChatCompletion",
        "ChatCompletionChunk",
        {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 2},
    ),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(("path", "whole", "chunk", "body"), CASES, ids=["completion", "chat"])
async def test_daemon_answers_match_the_document(
    client: Any, path: str, whole: str, chunk: str, body: dict[str, Any]
) -> None:
    resp = await client.post(path, json={**body, **EXTRAS})
    assert resp.status == 200
    _validator(whole).validate(await resp.json())

    options = {"stream": True, "stream_options": {"include_usage": True}}
    resp = await client.post(path, json={**body, **EXTRAS, **options})
    events = await read_events(resp)
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        _validator(chunk).validate(event)

    resp = await client.post(path, json={**body, "max_tokens": 0})
    assert resp.status == 400
    _validator("Error").validate(await resp.json())


@pytest.mark.asyncio
async def test_models_health_and_the_document_itself(client: Any) -> None:
    _validator("ModelList").validate(await (await client.get("/v1/models")).json())
    _validator("Health").validate(await (await client.get("/health")).json())
    resp = await client.get(OPENAPI_PATH)
    assert resp.content_type == "application/json"
    assert json.loads(await resp.read()) == json.loads(json.dumps(openapi_document()))
