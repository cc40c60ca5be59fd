"""The router as an HTTP server: JSON errors, body limit, request ids, CORS, metrics, keys.

Against fake daemons (tests/router_helpers.py); tests/test_router_public_http.py repeats the
points that matter with real processes.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from edgeinfer.router.app import reload_daemon_key
from edgeinfer.router.proxy import PROXY_KEY
from edgeinfer.router.tenants import key_digest
from edgeinfer.shared.request_ids import RequestIdFilter
from router_helpers import COMPLETION, Cluster, start_cluster

KEY = "ei-test-key-of-tenant-acme"


@pytest_asyncio.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with start_cluster(tmp_path) as c:
        yield c


async def error_of(resp: aiohttp.ClientResponse) -> dict[str, Any]:
    """The OpenAI error object of a router answer, checking its shape and content type."""
    assert resp.content_type == "application/json"
    body = await resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error: dict[str, Any] = body["error"]
    return error


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


# ---- errors are OpenAI error objects ----


@pytest.mark.asyncio
async def test_unknown_path_is_a_json_404(cluster: Cluster) -> None:
    async with cluster.http.get(cluster.url + "/v1/nope") as resp:
        assert resp.status == 404
        error = await error_of(resp)
        assert resp.headers["X-Request-Id"]
    assert error["code"] == "not_found" and "/v1/nope" in str(error["message"])


@pytest.mark.asyncio
async def test_wrong_method_is_a_json_405_with_allow(cluster: Cluster) -> None:
    async with cluster.http.get(cluster.url + "/v1/chat/completions") as resp:
        assert resp.status == 405
        error = await error_of(resp)
        assert resp.headers["Allow"] == "POST"
    assert error["code"] == "method_not_allowed"


@pytest.mark.asyncio
async def test_body_over_max_body_bytes_is_a_json_413(tmp_path: Path) -> None:
    async with start_cluster(tmp_path, extra={"max_body_bytes": "4096"}) as cluster:
        async with await cluster.post({**COMPLETION, "prompt": "x" * 3000}) as resp:
            assert resp.status == 200  # under the limit: the daemon judges it
        async with await cluster.post({**COMPLETION, "prompt": "x" * 5000}) as resp:
            assert resp.status == 413
            assert (await error_of(resp))["code"] == "request_too_large"
        assert len(cluster.fra.seen) == 1


@pytest.mark.asyncio
@pytest.mark.parametrize("field", ["kv_transfer_params", "data_parallel_rank"])
async def test_body_fields_naming_infrastructure_are_refused(cluster: Cluster, field: str) -> None:
    body = {**COMPLETION, field: {"prefill_endpoint": "tcp://evil.example:5555"}}
    async with await cluster.post(body) as resp:
        assert resp.status == 400
        error = await error_of(resp)
    assert error["param"] == field and error["type"] == "invalid_request_error"
    assert not cluster.fra.seen and not cluster.nyc.seen  # refused before any placement


@pytest.mark.asyncio
async def test_an_internal_error_is_a_json_500_logged_with_the_request_id(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def broken(*args: object) -> None:
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(cluster.app[PROXY_KEY], "forward", broken)
    caplog.handler.addFilter(RequestIdFilter())
    with caplog.at_level(logging.INFO):
        headers = {"X-Request-Id": "req-500"}
        async with await cluster.post(headers=headers) as resp:
            assert resp.status == 500
            error = await error_of(resp)
            assert resp.headers["X-Request-Id"] == "req-500"
    assert "secret" not in str(error["message"]) and "req-500" in str(error["message"])
    logged = [r for r in caplog.records if r.exc_info and "internal error" in r.getMessage()]
    assert logged and logged[0].request_id == "req-500"  # type: ignore[attr-defined]
    access = [r for r in caplog.records if r.name == "aiohttp.access"]
    assert access and all(r.request_id == "req-500" for r in access)  # type: ignore[attr-defined]


# ---- request ids ----


@pytest.mark.asyncio
async def test_request_id_round_trip(cluster: Cluster) -> None:
    async with await cluster.post(headers={"X-Request-Id": "client:id-1.2_3"}) as resp:
        assert resp.headers["X-Request-Id"] == "client:id-1.2_3"
    assert cluster.fra.seen[-1]["headers"]["X-Request-Id"] == "client:id-1.2_3"
    for bad in ("has space", "x" * 129, "semi;colon"):
        async with await cluster.post(headers={"X-Request-Id": bad}) as resp:
            replaced = resp.headers["X-Request-Id"]
        assert re.fullmatch(r"[0-9a-f]{32}", replaced)
        assert cluster.fra.seen[-1]["headers"]["X-Request-Id"] == replaced
    async with await cluster.post() as resp:
        generated = resp.headers["X-Request-Id"]
    assert re.fullmatch(r"[0-9a-f]{32}", generated) and generated != replaced
    assert cluster.fra.seen[-1]["headers"]["X-Request-Id"] == generated


# ---- the daemon key ----


@pytest.mark.asyncio
async def test_daemons_get_the_routers_key_never_the_clients(tmp_path: Path) -> None:
    key_file = tmp_path / "daemon-key"
    key_file.write_text("daemon-key-1\n")
    extra = {"daemon_api_key_file": f'"{key_file}"'}
    async with start_cluster(tmp_path, extra=extra) as cluster:
        async with await cluster.post(headers={"Authorization": "Bearer client-key"}) as resp:
            assert resp.status == 200
        assert cluster.fra.seen[-1]["headers"]["Authorization"] == "Bearer daemon-key-1"
        assert cluster.fra.state_headers[-1]["Authorization"] == "Bearer daemon-key-1"
        key_file.write_text("daemon-key-2\n")
        reload_daemon_key(cluster.app)  # what SIGHUP does
        async with await cluster.post() as resp:
            assert resp.status == 200
        assert cluster.fra.seen[-1]["headers"]["Authorization"] == "Bearer daemon-key-2"
        key_file.write_text("")
        reload_daemon_key(cluster.app)  # a broken file keeps the current key
        async with await cluster.post() as resp:
            assert resp.status == 200
        assert cluster.fra.seen[-1]["headers"]["Authorization"] == "Bearer daemon-key-2"


# ---- API keys (the Gate) ----


def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys.toml"
    path.write_text(
        f'[[key]]\ntenant = "acme"\nsha256 = "{key_digest(KEY)}"\nrequests_per_minute = 1000\n'
    )
    return path


@pytest.mark.asyncio
async def test_every_v1_route_needs_a_key_and_the_tenant_reaches_the_daemon(
    tmp_path: Path,
) -> None:
    extra = {"api_keys_file": f'"{keys_file(tmp_path)}"'}
    async with start_cluster(tmp_path, extra=extra) as cluster:
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions")):
            async with cluster.http.request(method, cluster.url + path, json=COMPLETION) as resp:
                assert resp.status == 401
                assert (await error_of(resp))["code"] == "invalid_api_key"
                assert resp.headers["X-Request-Id"]
        assert not cluster.fra.seen and not cluster.nyc.seen
        async with cluster.http.get(cluster.url + "/health") as resp:
            assert resp.status == 200  # not under /v1: ops, no key
        auth = {"Authorization": f"Bearer {KEY}"}
        async with await cluster.post(headers=auth) as resp:
            assert resp.status == 200
            assert resp.headers["x-ratelimit-limit-requests"] == "1000"
            assert resp.headers["X-Request-Id"]
        seen = cluster.fra.seen[-1]["headers"]
        assert (seen["x-edge-tenant"], seen["x-edge-cache-salt"]) == ("acme", "acme")
        assert "Authorization" not in seen
        async with cluster.http.get(cluster.url + "/metrics") as resp:
            text = await resp.text()
        assert KEY not in text and key_digest(KEY) not in text
        values = samples(text)
        assert values[("edgeinfer_router_unauthorized_total", ())] == 2
        labels = (("pop", "fra"), ("route", "/v1/completions"), ("status", "200"))
        assert values[("edgeinfer_router_requests_total", (*labels, ("tenant", "acme")))] == 1


@pytest.mark.asyncio
async def test_the_access_line_names_the_tenant_and_the_pop_that_answered(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    extra = {"api_keys_file": f'"{keys_file(tmp_path)}"'}
    async with start_cluster(tmp_path, extra=extra) as cluster:
        with caplog.at_level(logging.INFO, logger="aiohttp.access"):
            async with await cluster.post(headers={"Authorization": f"Bearer {KEY}"}) as resp:
                assert resp.status == 200
                pop = resp.headers["x-edge-decode-pop"]
                await resp.read()
            async with cluster.http.post(cluster.url + "/v1/completions", json=COMPLETION) as resp:
                assert resp.status == 401

            def lines() -> list[logging.LogRecord]:
                # The router's (the fake daemons write aiohttp's own, without these fields).
                return [r for r in caplog.records if hasattr(r, "decode_pop")]

            # Each line is written once its response has gone out: wait for the second.
            for _ in range(500):
                if len(lines()) >= 2:
                    break
                await asyncio.sleep(0.01)
    assert [r.getMessage().split('"')[1] for r in lines()] == ["POST /v1/completions HTTP/1.1"] * 2
    served, refused = lines()
    assert served.getMessage().endswith(f" tenant=acme decode_pop={pop}")
    assert (served.response_status, served.tenant, served.decode_pop) == (200, "acme", pop)  # type: ignore[attr-defined]
    assert " 401 " in refused.getMessage() and refused.getMessage().endswith(
        " tenant=- decode_pop=-"
    )


# ---- CORS ----


@pytest.mark.asyncio
async def test_cors_preflight_and_actual_request(tmp_path: Path) -> None:
    extra = {"cors_allowed_origins": '["https://app.example.com"]'}
    async with start_cluster(tmp_path, extra=extra) as cluster:
        preflight = {
            "Origin": "https://app.example.com",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        }
        url = cluster.url + "/v1/chat/completions"
        async with cluster.http.options(url, headers=preflight) as resp:
            assert resp.status == 200
            assert resp.headers["Access-Control-Allow-Origin"] == "https://app.example.com"
            assert resp.headers["Access-Control-Allow-Methods"] == "POST"
            allowed = {
                h.strip().lower() for h in resp.headers["Access-Control-Allow-Headers"].split(",")
            }
            assert {"authorization", "content-type"} <= allowed
            assert "Access-Control-Allow-Credentials" not in resp.headers
        other = {**preflight, "Origin": "https://evil.example.com"}
        async with cluster.http.options(url, headers=other) as resp:
            assert resp.status == 403
            await error_of(resp)
        headers = {"Origin": "https://app.example.com"}
        async with await cluster.post(headers=headers) as resp:
            assert resp.status == 200
            assert resp.headers["Access-Control-Allow-Origin"] == "https://app.example.com"
            exposed = {h.lower() for h in resp.headers["Access-Control-Expose-Headers"].split(",")}
        assert {"x-request-id", "retry-after", "x-ratelimit-remaining-requests"} <= exposed
        async with await cluster.post(headers={"Origin": "https://evil.example.com"}) as resp:
            assert "Access-Control-Allow-Origin" not in resp.headers


@pytest.mark.asyncio
async def test_no_cors_without_origins(cluster: Cluster) -> None:
    headers = {"Origin": "https://app.example.com", "Access-Control-Request-Method": "POST"}
    async with cluster.http.options(cluster.url + "/v1/completions", headers=headers) as resp:
        assert resp.status == 405
        await error_of(resp)
    async with await cluster.post(headers={"Origin": "https://app.example.com"}) as resp:
        assert "Access-Control-Allow-Origin" not in resp.headers


# ---- metrics ----


@pytest.mark.asyncio
async def test_metrics_count_routes_statuses_pops_and_retries(cluster: Cluster) -> None:
    cluster.fra.fail_status = 503  # one retry, answered by nyc
    async with await cluster.post({**COMPLETION, "stream": True}) as resp:
        assert resp.status == 200
        await resp.read()
    async with cluster.http.get(cluster.url + "/v1/unknown/path/abc") as resp:
        assert resp.status == 404
    async with cluster.http.get(cluster.url + "/metrics") as resp:
        assert resp.status == 200
        values = samples(await resp.text())
    ok = (("pop", "nyc"), ("route", "/v1/completions"), ("status", "200"), ("tenant", ""))
    assert values[("edgeinfer_router_requests_total", ok)] == 1
    missing = (("pop", ""), ("route", "unmatched"), ("status", "404"), ("tenant", ""))
    assert values[("edgeinfer_router_requests_total", missing)] == 1
    assert values[("edgeinfer_router_upstream_retries_total", (("reason", "unavailable"),))] == 1
    assert values[("edgeinfer_router_placement_seconds_count", ())] == 1
    assert values[("edgeinfer_router_streams_in_flight", ())] == 0
    # The shared rate-limit store's health is exported (memory storage: never degraded).
    assert values[("edgeinfer_router_rate_limit_storage_errors_total", ())] == 0
    assert values[("edgeinfer_router_rate_limit_storage_degraded", ())] == 0
    assert not any("abc" in str(labels) for _, labels in values)  # raw paths never


def test_request_features_and_infrastructure_fields_share_one_parse() -> None:
    from edgeinfer.router.openai_api import infrastructure_field, parse_body, request_features

    body = orjson.dumps({**COMPLETION, "kv_transfer_params": {}})
    data = parse_body(body)
    assert request_features(body, data).model == COMPLETION["model"]
    refused = infrastructure_field(data)
    assert refused is not None and refused.status == 400
    assert infrastructure_field(parse_body(b"[1, 2]")) is None
    assert infrastructure_field(parse_body(b"not json")) is None
