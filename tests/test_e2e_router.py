"""The global router end to end: real edge-daemon and edge-router processes (issue: Global router).

Three PoPs on three continents, at the coordinates the MaxMind test database gives three of
its cities, so an X-Forwarded-For address from each continent has a known nearest PoP:

* ``lhr`` (London): a prefill daemon and a decode daemon, the router's own PoP;
* ``sea`` (Milton, WA) and ``cgq`` (Changchun): one ``both`` daemon each.

One router and four tiny-model daemons serve every test of the module (starting them is most of
its run time). The last test kills a daemon, so it stays last.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cluster import Proc, cluster, free_port, metric, wait_healthy
from e2e_helpers import (
    DAEMON_AUTH,
    DAEMON_KEY,
    TOKEN,
    Reply,
    admin,
    chat,
    edgectl,
    request,
    wait_all_up,
    wait_idle,
)
from edgeinfer.daemon.engine.tiny_checkpoint import build_tiny_checkpoint

GEOIP_DB = Path(__file__).parent / "data" / "geoip" / "GeoIP2-City-Test.mmdb"
# Test-DB addresses, one continent each; Linköping is nearer London than any other PoP.
LONDON, LINKOPING, MILTON, CHANGCHUN = (
    "81.2.69.160",
    "89.160.20.112",
    "216.160.83.56",
    "175.16.199.0",
)
POPS = {"lhr": (51.5142, -0.0931), "sea": (47.2513, -122.3149), "cgq": (43.88, 125.3228)}
# The decode daemon advertises it: prompts over this many tokens go to a prefill daemon.
LOCAL_PREFILL_MAX = 16
LONG_PROMPT = "Tell me about the little town by the sea and the baker who lived there. " * 4


@dataclass
class World:
    router: Proc
    prefill: Proc  # lhr
    decode: Proc  # lhr
    sea: Proc
    cgq: Proc

    def decode_daemon(self, pop: str) -> Proc:
        return {"lhr": self.decode, "sea": self.sea, "cgq": self.cgq}[pop]


def router_config(path: Path, port: int, members: dict[str, list[Proc]], token: Path) -> Path:
    key = path.parent / "daemon-key"
    key.write_text(DAEMON_KEY + "\n")
    lines = [
        "[router]",
        f'daemon_api_key_file = "{key}"',
        f'listen = "127.0.0.1:{port}"',
        'here = "lhr"',
        f'geoip_db = "{GEOIP_DB}"',
        'trusted_proxies = ["127.0.0.1/32"]',
        f'admin_token_file = "{token}"',
        # Daemons beat every 0.3 s; judging staleness against 1 s keeps a loaded CI machine's
        # late heartbeats from dropping daemons, and a loose ITL SLO keeps placement geographic
        # (these tests are about geography, retries and drains, not about the cost model).
        "heartbeat_interval_s = 1.0",
        "itl_slo_s = 5.0",
        "discovery_interval_s = 0.2",
        # All PoPs share this machine, so probe RTTs would measure load, not distance (and a
        # daemon busy starting up would look far away): keep placement purely geographic here;
        # tests/test_netns.py covers measured RTTs over links with real delays.
        "catchment_km = 0.0",
        "rtt_probe_interval_s = 1.0",
    ]
    for name, procs in members.items():
        lat, lon = POPS[name]
        urls = ", ".join(f'"{p.url}"' for p in procs)
        lines += ["", "[[pop]]", f'name = "{name}"', f"lat = {lat}", f"lon = {lon}"]
        lines.append(f"daemons = [{urls}]")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("e2e_router")
    model = build_tiny_checkpoint(tmp / "model")
    env = {"EDGEINFER_ADMIN_TOKEN": TOKEN, "EDGEINFER_API_KEY": DAEMON_KEY}
    with cluster(tmp) as c:
        prefill = c.daemon("lhr-prefill", model, "--role", "prefill", "--pop", "lhr", env=env)
        decode = c.daemon(
            "lhr-decode", model, "--role", "decode", "--pop", "lhr",
            "--local-prefill-threshold", str(LOCAL_PREFILL_MAX), env=env,
        )  # fmt: skip
        sea = c.daemon("sea-both", model, "--role", "both", "--pop", "sea", env=env)
        cgq = c.daemon("cgq-both", model, "--role", "both", "--pop", "cgq", env=env)
        token = tmp / "admin-token"
        token.write_text(TOKEN + "\n")
        members = {"lhr": [prefill, decode], "sea": [sea], "cgq": [cgq]}
        port = free_port()
        router = c.router("router", router_config(tmp / "router.toml", port, members, token), port)
        for proc in (prefill, decode, sea, cgq):
            wait_healthy(proc)
        wait_all_up(router, 4)
        yield World(router, prefill, decode, sea, cgq)


def test_chat_streams_through_the_router_as_a_direct_daemon_answers(world: World) -> None:
    direct = chat(world.sea.url, LONG_PROMPT, stream=False, headers=DAEMON_AUTH)
    direct_stream = chat(world.sea.url, LONG_PROMPT, headers=DAEMON_AUTH)
    kv_sent = metric(world.prefill.url, "edgeinfer_kv_transfer_bytes_total", 'direction="sent"')
    via = chat(world.router.url, LONG_PROMPT, xff=LONDON)
    assert via.ok, via
    # A long prompt from London: decoded in London, its KV computed by London's prefill daemon.
    assert (via.decode_pop, via.prefill_pop) == ("lhr", "lhr")
    assert metric(world.prefill.url, "edgeinfer_kv_transfer_bytes_total", 'direction="sent"') > (
        kv_sent
    )
    # Chunk by chunk: the same SSE events as straight from a daemon, none merged or split.
    assert len(via.deltas()) > 1
    assert via.deltas() == direct_stream.deltas()
    assert "".join(via.deltas()) == json.loads(direct.body)["choices"][0]["message"]["content"]


@pytest.mark.parametrize(
    ("xff", "pop"),
    [(LONDON, "lhr"), (LINKOPING, "lhr"), (MILTON, "sea"), (CHANGCHUN, "cgq"), (None, "lhr")],
    ids=["europe", "europe-2", "north-america", "asia", "no-xff-is-here"],
)
def test_clients_are_placed_on_their_nearest_pop(world: World, xff: str | None, pop: str) -> None:
    # A heartbeat taken while the last test's request waited would price it for a while (a
    # loaded machine's slow decode rate makes that wait outweigh the continents).
    wait_idle(world.router)
    reply = chat(world.router.url, "Hi", xff=xff, max_tokens=4)
    assert reply.ok, reply
    # A short prompt is prefilled where it is decoded.
    assert (reply.decode_pop, reply.prefill_pop) == (pop, pop)


@pytest.mark.parametrize(
    "body",
    [b"{not json", b'{"messages": "hi"}', b'{"messages": [{"role": "user", "content": "x"}], '
     b'"max_tokens": -3}', b'{"prompt": "x", "max_tokens": 2}'],
    ids=["not-json", "messages-not-a-list", "negative-max-tokens", "completion-body-on-chat"],
)  # fmt: skip
def test_a_daemons_4xx_passes_through_unchanged(world: World, body: bytes) -> None:
    via = request(world.router.url + "/v1/chat/completions", "POST", body)
    assert via.decode_pop is not None
    daemon = world.decode_daemon(via.decode_pop)
    direct = request(daemon.url + "/v1/chat/completions", "POST", body, DAEMON_AUTH)
    assert 400 <= direct.status < 500
    assert (via.status, via.body) == (direct.status, direct.body)
    assert via.headers["content-type"] == direct.headers["content-type"]


def test_admin_api_refuses_a_bad_token(world: World) -> None:
    for token in ("wrong", ""):
        reply = admin(world.router, "/admin/pops", token=token)
        assert reply.status == 401
        assert reply.headers["www-authenticate"] == "Bearer"
        assert json.loads(reply.body)["error"]["code"] == "invalid_admin_token"
    assert admin(world.router, "/admin/pops/lhr/drain", "POST", token="wrong").status == 401
    pops = json.loads(admin(world.router, "/admin/pops").body)["pops"]
    assert not any(p["draining"] for p in pops)  # the refused drain did nothing
    cli = edgectl(world.router, "status", token="wrong")
    err = cli.communicate(timeout=30)[1]
    assert cli.returncode == 1
    assert "refused the admin token" in err


class Load:
    """Client threads sending short London chats back to back until stopped."""

    def __init__(self, router: Proc, threads: int = 2) -> None:
        self.router = router
        self.replies: list[Reply] = []
        self.errors: list[BaseException] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run) for _ in range(threads)]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.replies.append(chat(self.router.url, "Hi there", xff=LONDON, max_tokens=8))
            except Exception as exc:  # a broken connection is a failed request, not a crash
                self.errors.append(exc)

    def wait_for(self, pop: str, since: float, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not any(r.sent_at > since and r.decode_pop == pop for r in list(self.replies)):
            assert time.monotonic() < deadline, f"no request reached {pop} in {timeout}s"
            time.sleep(0.05)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


def test_drain_under_load_loses_nothing_and_undrain_restores(world: World) -> None:
    load = Load(world.router)
    try:
        load.wait_for("lhr", since=0.0)
        # A long stream runs in London when the drain starts; it must finish, not be cut. How
        # long "long" is depends on the host: a stream that ended before the drain was
        # acknowledged proves nothing, so that attempt is undone and retried with more tokens.
        for max_tokens in (200, 600, 1800):
            streaming, long = threading.Event(), list[Reply]()
            long_thread = threading.Thread(
                target=lambda out=long, n=max_tokens, ev=streaming: out.append(
                    chat(world.router.url, "Hi", xff=LONDON, max_tokens=n, streaming=ev)))  # fmt: skip
            long_thread.start()
            assert streaming.wait(30)
            drain = edgectl(world.router, "drain", "lhr", "--wait", "--poll-interval", "0.1")
            assert drain.stdout is not None
            ack = drain.stdout.readline()
            acked_at = time.monotonic()  # every request sent from here on came after the ack
            assert ack.startswith("lhr: draining,"), ack
            if long_thread.is_alive() and "0 requests" not in ack:
                break
            drain.communicate(timeout=60)
            long_thread.join(30)
            undo = edgectl(world.router, "undrain", "lhr")
            assert undo.communicate(timeout=30)[0] == "lhr: accepting requests\n"
        else:
            pytest.fail("even 1800 tokens ended before the drain was acknowledged")
        rest, err = drain.communicate(timeout=60)
        assert drain.returncode == 0, err
        assert "lhr: drained, no requests in flight" in rest
        pop = json.loads(admin(world.router, "/admin/pops/lhr").body)
        assert pop["draining"] and pop["in_flight"] == 0
        long_thread.join(30)
        assert long and long[0].ok  # every token, then [DONE]
        assert long[0].events[-1]["choices"][0]["finish_reason"] == "length"
        load.wait_for("sea" if load.replies[-1].decode_pop == "sea" else "cgq", since=acked_at)
        undrain_at = time.monotonic()
        undrain = edgectl(world.router, "undrain", "lhr")
        assert undrain.communicate(timeout=30)[0] == "lhr: accepting requests\n"
        load.wait_for("lhr", since=time.monotonic())
    finally:
        load.close()
    assert not load.errors
    failed = [r for r in load.replies if not r.ok]
    assert not failed, failed[:3]
    # Placed (sent and answered) while lhr was drained: none of them went there.
    drained = [r for r in load.replies if acked_at < r.sent_at and r.finished_at < undrain_at]
    assert len(drained) >= 3
    assert [r for r in drained if "lhr" in (r.decode_pop, r.prefill_pop)] == []


def test_killed_daemon_is_retried_elsewhere_not_a_client_error(world: World) -> None:
    # The earlier tests' load can leave a Changchun client placed elsewhere for a while (load
    # in cgq's last heartbeat, prefixes cached in lhr and sea): wait until cgq is its choice,
    # so the request below is really sent to the killed daemon.
    deadline = time.monotonic() + 30
    while chat(world.router.url, "Hi", xff=CHANGCHUN, max_tokens=1).decode_pop != "cgq":
        assert time.monotonic() < deadline, "a Changchun client never placed on cgq"
        time.sleep(0.2)
    world.cgq.kill()  # SIGKILL: its last heartbeat still says it is fine for ~1 s
    # Near-ties spread over the daemons this router used least lately, so the next request may
    # go elsewhere although cgq is as good: ask until one was sent to cgq (while its last
    # heartbeat says it is up) and retried. Every answer must be a good one.
    for _ in range(40):
        reply = chat(world.router.url, "Hi", xff=CHANGCHUN, max_tokens=4)
        assert reply.ok, reply
        assert reply.decode_pop in ("lhr", "sea")
        if "(connect failed" in world.router.output():
            break
    assert "(connect failed" in world.router.output()  # retried: it never got the request
    daemons = json.loads(admin(world.router, "/admin/pops/cgq").body)["daemons"]
    assert [d["state"] for d in daemons] == ["down"]
    assert chat(world.router.url, "Hi", xff=CHANGCHUN, max_tokens=4).ok
