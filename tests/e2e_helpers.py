"""Client side of the end-to-end router tests: blocking HTTP and SSE against real processes.

Blocking ``http.client`` on purpose: every call is one real client connection (no pooling that
could hide a proxy bug), and a thread per client is all the load generator needs.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from cluster import Proc

TOKEN = "e2e-admin-token"
# The routers' key to their daemons (the daemons' api_key); a test calling a daemon directly
# presents it as the router would.
DAEMON_KEY = "e2e-daemon-key"
DAEMON_AUTH = {"Authorization": f"Bearer {DAEMON_KEY}"}
# The module, not the console script: the script exists only once the venv is reinstalled.
EDGECTL = [sys.executable, "-m", "edgeinfer.ctl.main"]


@dataclass
class Reply:
    status: int
    headers: dict[str, str]  # lower-cased names
    body: bytes
    events: list[dict[str, Any]] = field(default_factory=list)  # SSE data events, in order
    done: bool = False  # the stream ended with data: [DONE]
    sent_at: float = 0.0
    finished_at: float = 0.0

    @property
    def decode_pop(self) -> str | None:
        return self.headers.get("x-edge-decode-pop")

    @property
    def prefill_pop(self) -> str | None:
        return self.headers.get("x-edge-prefill-pop")

    def deltas(self) -> list[str]:
        """The content of each chat chunk, one entry per SSE event that carried a choice."""
        return [e["choices"][0]["delta"].get("content") or "" for e in self.events if e["choices"]]

    @property
    def ok(self) -> bool:
        """A complete, error-free answer: what a client counts as a successful request."""
        if self.status != 200:
            return False
        if self.headers.get("content-type", "").startswith("text/event-stream"):
            return self.done and not any("error" in e for e in self.events)
        return "choices" in json.loads(self.body)


def request(
    url: str,
    method: str = "GET",
    body: bytes | dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 60.0,
    streaming: threading.Event | None = None,
) -> Reply:
    """One request on a fresh connection; an SSE body is parsed event by event as it arrives."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    sent_at = time.monotonic()
    try:
        conn.request(method, parts.path, body=data, headers={
            "Content-Type": "application/json", **(headers or {})})  # fmt: skip
        resp = conn.getresponse()
        reply = Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, b"")
        reply.sent_at = sent_at
        if reply.headers.get("content-type", "").startswith("text/event-stream"):
            for raw in resp:  # one line at a time, as the proxy forwards it
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    reply.done = True
                elif line.startswith("data: "):
                    reply.events.append(json.loads(line[6:]))
                    if streaming is not None:
                        streaming.set()
        else:
            reply.body = resp.read()
    finally:
        conn.close()
    reply.finished_at = time.monotonic()
    return reply


def chat(
    base: str,
    content: str,
    *,
    xff: str | None = None,
    max_tokens: int = 12,
    stream: bool = True,
    streaming: threading.Event | None = None,
    headers: dict[str, str] | None = None,
) -> Reply:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream}  # fmt: skip
    headers = {**(headers or {}), **({"X-Forwarded-For": xff} if xff else {})}
    return request(base + "/v1/chat/completions", "POST", body, headers, streaming=streaming)


def admin(router: Proc, path: str, method: str = "GET", token: str = TOKEN) -> Reply:
    return request(router.url + path, method, b"", {"Authorization": f"Bearer {token}"})


def edgectl(router: Proc, *args: str, token: str = TOKEN) -> subprocess.Popen[str]:
    """``edgectl ARGS`` against ``router``, stdout line-buffered for the caller to read."""
    env = {**os.environ, "EDGEINFER_ROUTER": router.url, "EDGEINFER_ADMIN_TOKEN": token}
    return subprocess.Popen(
        [*EDGECTL, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def router_daemons(router: Proc) -> list[dict[str, Any]] | None:
    """The daemons ``/admin/pops`` lists (None: the router did not answer it yet)."""
    if router.popen.poll() is not None:
        raise RuntimeError(f"router exited:\n{router.output()}")
    reply = admin(router, "/admin/pops")
    if reply.status != 200:
        return None
    return [d for p in json.loads(reply.body)["pops"] for d in p["daemons"]]


def wait_idle(router: Proc, quiet_s: float = 1.0, timeout: float = 60.0) -> None:
    """Until every daemon the router knows has reported no running, waiting or in-flight
    request for ``quiet_s``: heartbeats that late show the last request done, and the router's
    ledger has let its placements go. Geography is then all that sets daemons apart."""
    deadline = time.monotonic() + timeout
    since: float | None = None
    daemons: list[dict[str, Any]] | None = None
    while time.monotonic() < deadline:
        daemons = router_daemons(router)
        now = time.monotonic()
        if daemons is None or any(d["running"] or d["waiting"] or d["in_flight"] for d in daemons):
            since = None
        elif since is None:
            since = now
        elif now - since >= quiet_s:
            return
        time.sleep(0.05)
    raise TimeoutError(f"daemons not idle after {timeout}s: {daemons}")


def wait_all_up(router: Proc, count: int, timeout: float = 60.0) -> None:
    """Until the router places on ``count`` daemons (discovered, heartbeating, undrained)."""
    deadline = time.monotonic() + timeout
    states: list[str] = []
    while time.monotonic() < deadline:
        daemons = router_daemons(router)
        if daemons is not None:
            states = [d["state"] for d in daemons]
            if states.count("up") == count:
                return
        time.sleep(0.1)
    raise TimeoutError(f"daemons not all up after {timeout}s: {states}\n{router.output()}")
