"""Schemathesis against a real tiny daemon and a real router in front of it (issue 16, §5).

Both processes serve ``/openapi.json``; each operation of that document is fuzzed on both, with
bodies that follow the document (positive) and bodies that break it (negative). Every answer must
conform to the document (status, content type, headers, body, SSE events), no answer may be a
5xx, a body that breaks the document must be refused with a 4xx, and every 4xx/5xx must be an
OpenAI error object served as ``application/json``. Keys are on, as on a public endpoint (the
router's api_keys_file with limits, so every answer carries ``x-ratelimit-*``; the daemon's
api_key, which the router sends). Afterwards both processes must still be healthy, stop cleanly
on SIGTERM and leave nothing running.

The document is narrowed to this deployment before fuzzing, only where the daemon enforces the
narrower rule alone (so negative cases stay true negatives): the served model's name, the roles
and content the tiny model's chat template takes, token ids below the vocabulary size, and
``max_tokens`` below the context length, which also bounds the work each request costs.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema_rs
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from cluster import Proc, cluster, free_port, http_get, wait_healthy
from edgeinfer.daemon.engine.tiny_checkpoint import build_tiny_checkpoint
from edgeinfer.router.tenants import key_digest
from edgeinfer.shared import processes
from edgeinfer.shared.openapi import openapi_document

pytestmark = pytest.mark.slow

# Requests per operation, process and mode (the GET operations take no input: one each).
MAX_EXAMPLES = 50
MAX_MODEL_LEN = 96
CLIENT_KEY = "ei-schemathesis-client-key"
DAEMON_KEY = "schemathesis-router-to-daemon-key"
VOCAB_SIZE = 512  # build_tiny_checkpoint's default
POSITIVE, NEGATIVE = schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE
GENERATE = ["POST /v1/completions", "POST /v1/chat/completions"]
# The GET operations take no input, so they have no negative cases.
RUNS = [
    *((label, mode) for label in GENERATE for mode in (POSITIVE, NEGATIVE)),
    *((label, POSITIVE) for label in ("GET /v1/models", "GET /health", "GET /openapi.json")),
]


@dataclass
class Servers:
    daemon: Proc
    router: Proc
    model: str

    def target(self, name: str) -> tuple[str, dict[str, str]]:
        """Base URL of ``name`` and the key a legitimate caller sends it."""
        if name == "daemon":
            return self.daemon.url, {"Authorization": f"Bearer {DAEMON_KEY}"}
        return self.router.url, {"Authorization": f"Bearer {CLIENT_KEY}"}


def _router_config(tmp: Path, port: int, daemon: Proc) -> Path:
    keys = tmp / "keys.toml"
    # Limits far above what the run sends, so that every answer carries x-ratelimit-* headers
    # and none is a 429.
    keys.write_text(
        f'[[key]]\ntenant = "fuzz"\nsha256 = "{key_digest(CLIENT_KEY)}"\n'
        "requests_per_minute = 100000\ntokens_per_minute = 1000000000\nmax_concurrent = 8\n"
    )
    (tmp / "daemon-key").write_text(DAEMON_KEY + "\n")
    path = tmp / "router.toml"
    path.write_text(
        f'[router]\nlisten = "127.0.0.1:{port}"\nhere = "lhr"\n'
        f'api_keys_file = "{keys}"\ndaemon_api_key_file = "{tmp / "daemon-key"}"\n'
        "heartbeat_interval_s = 1.0\ndiscovery_interval_s = 0.2\n\n"
        f'[[pop]]\nname = "lhr"\nlat = 51.5\nlon = -0.1\ndaemons = ["{daemon.url}"]\n'
    )
    return path


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    tmp = tmp_path_factory.mktemp("schemathesis")
    model = build_tiny_checkpoint(tmp / "model")
    env = {
        "EDGEINFER_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
        "EDGEINFER_NUM_KV_BLOCKS": "64",
        "EDGEINFER_API_KEY": DAEMON_KEY,
    }
    with cluster(tmp) as c:
        daemon = c.daemon("daemon", model, "--role", "both", "--pop", "lhr", env=env)
        port = free_port()
        router = c.router("router", _router_config(tmp, port, daemon), port)
        wait_healthy(daemon)
        wait_healthy(router)  # 200 once the router can place a request on the daemon
        status, body = processes.http_get(daemon.url + "/v1/models", token=DAEMON_KEY)
        assert status == 200, body
        yield Servers(daemon, router, json.loads(body)["data"][0]["id"])


def _narrowed(document: dict[str, Any], model: str) -> dict[str, Any]:
    doc = copy.deepcopy(document)
    schemas = doc["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas[name]["properties"]
        props["model"] = {"enum": [model, None]}
        for field in ("max_tokens", "max_completion_tokens"):
            if field in props:
                props[field]["maximum"] = MAX_MODEL_LEN - 1
    # The tiny model's chat template takes these roles and needs a content.
    message = schemas["ChatMessage"]
    message["properties"]["role"] = {"enum": ["system", "user", "assistant"]}
    message["properties"]["content"]["anyOf"].remove({"type": "null"})
    message["required"] = ["role", "content"]
    ids = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    for token_ids in (ids[1], ids[2]["items"]["anyOf"][1]):
        token_ids["items"]["maximum"] = VOCAB_SIZE - 1
    return doc


# Failure reports show requests as sent: these keys are the test's own, and sanitising would
# also hide every body field with "token" in its name (max_tokens).
_CONFIG = schemathesis.Config.from_dict({"output": {"sanitization": {"enabled": False}}})


def _operation(label: str, document: dict[str, Any] | None = None) -> schemathesis.APIOperation:
    doc = document if document is not None else copy.deepcopy(openapi_document())
    operation = schemathesis.openapi.from_dict(doc, config=_CONFIG).find_operation_by_label(label)
    assert operation is not None, label
    return operation


_ERROR_VALIDATOR = jsonschema_rs.validator_for(
    {"$ref": "#/components/schemas/Error", "components": openapi_document()["components"]}
)


@schemathesis.check
def openai_error_object(
    ctx: schemathesis.CheckContext, response: schemathesis.Response, case: schemathesis.Case
) -> bool | None:
    """Every 4xx/5xx of every operation and process is OpenAI's error object, as JSON (but a
    daemon's /health 503, which carries its phase for load balancers, as documented)."""
    if response.status_code < 400 or case.operation.path == "/health":
        return None
    content_type = response.headers.get("content-type", [""])[0]
    assert content_type.startswith("application/json"), (
        f"{response.status_code} answered as {content_type!r}: {response.text[:200]!r}"
    )
    _ERROR_VALIDATOR.validate(json.loads(response.text))
    return True


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    openai_error_object,
]


def test_both_processes_serve_the_document(servers: Servers) -> None:
    for proc in (servers.daemon, servers.router):
        status, body = http_get(proc.url + "/openapi.json")  # needs no key
        assert status == 200
        assert json.loads(body) == json.loads(json.dumps(openapi_document()))


@pytest.mark.parametrize(("label", "mode"), RUNS, ids=[f"{lb}-{m.value}" for lb, m in RUNS])
@pytest.mark.parametrize("target", ["daemon", "router"])
def test_fuzz(servers: Servers, target: str, label: str, mode: schemathesis.GenerationMode) -> None:
    base, auth = servers.target(target)
    operation = _operation(label, _narrowed(openapi_document(), servers.model))
    checks = [*CHECKS, negative_data_rejection] if mode.is_negative else CHECKS

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.generate],  # no shrinking: each failure report carries its curl command
        suppress_health_check=list(HealthCheck),
    )
    def fuzz(case: schemathesis.Case) -> None:
        case.call_and_validate(base_url=base, headers=auth, checks=checks, timeout=60)

    fuzz()


@pytest.mark.parametrize("label", ["POST /v1/completions", "GET /v1/models"])
@pytest.mark.parametrize("target", ["daemon", "router"])
@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_without_a_valid_key(servers: Servers, target: str, label: str, key: str | None) -> None:
    """Keys are on here: without one, or with a wrong one, the documented 401 error object."""
    operation = _operation(label)
    if operation.method == "post":
        case = operation.Case(body={"prompt": "Hi", "max_tokens": 2}, media_type="application/json")
    else:
        case = operation.Case()
    headers = {"Authorization": f"Bearer {key}"} if key else None
    base, _ = servers.target(target)
    response = case.call_and_validate(base_url=base, headers=headers, checks=CHECKS, timeout=60)
    assert response.status_code == 401
    assert json.loads(response.text)["error"]["code"] == "invalid_api_key"


CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
# Bodies the fuzzing's budget does not always reach, each of which once got a 500. Last: the
# one that failed the engine, and with it every later request.
HOSTILE = [
    ("POST /v1/completions", {"prompt": "Hi", "logit_bias": 5}),
    (
        "POST /v1/chat/completions",
        {**CHAT, "chat_template_kwargs": {"add_generation_prompt": True}},
    ),
    ("POST /v1/chat/completions", {**CHAT, "chat_template_kwargs": {"messages": []}}),
    ("POST /v1/completions", {"prompt": "Hi", "max_tokens": 2, "repetition_penalty": 1e307}),
]
HOSTILE_IDS = ["logit_bias-int", "kwargs-add_generation_prompt", "kwargs-messages", "huge-penalty"]


@pytest.mark.parametrize("target", ["daemon", "router"])
@pytest.mark.parametrize(("label", "body"), HOSTILE, ids=HOSTILE_IDS)
def test_hostile_bodies(servers: Servers, target: str, label: str, body: dict[str, Any]) -> None:
    operation = _operation(label)
    case = operation.Case(body=body, media_type="application/json")
    base, auth = servers.target(target)
    case.call_and_validate(base_url=base, headers=auth, checks=CHECKS, timeout=60)
    assert http_get(servers.daemon.url + "/health")[0] == 200, servers.daemon.output()


def _session_members(sid: int) -> list[int]:
    """Pids of live processes in session ``sid`` (each child runs in its own session)."""
    members = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:
                continue  # it exited while we looked
            # Fields after the parenthesised command: state ppid pgrp session ...
            fields = stat.rpartition(")")[2].split()
            if int(fields[3]) == sid and fields[0] != "Z":
                members.append(int(entry.name))
    return members


def test_both_processes_survive_and_stop_cleanly(servers: Servers) -> None:
    """Last in the module: after the fuzzing both answer /health, and SIGTERM ends them."""
    procs = (servers.router, servers.daemon)
    health = {p.name: http_get(p.url + "/health")[0] for p in procs}
    exits = {p.name: p.stop() for p in procs}
    left = {p.name: _session_members(p.pid) for p in procs}
    logs = "\n".join(p.output(2000) for p in procs)
    assert health == {"router": 200, "daemon": 200}, logs
    assert exits == {"router": 0, "daemon": 0}, logs
    assert left == {"router": [], "daemon": []}
