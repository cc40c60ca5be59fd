"""`make demo`: a whole edgeinfer network on this machine, and chats streamed through it.

Starts a router, one prefill PoP (Frankfurt) and two decode PoPs (London, Seattle) on 127.0.0.1
with the built-in model (:mod:`edgeinfer.ctl.local_cluster`), then:

1. a client in London asks a question with a system prompt: the router decodes it in London and
   has Frankfurt prefill it (the prompt is long enough to ship its KV), tokens stream to the
   terminal as they are generated;
2. a client in Milton, WA asks a short one: decoded and prefilled in Seattle;
3. after each, where it ran (the router's ``x-edge-*`` headers) and why (the router's cost
   breakdown of every candidate, from its debug log);
4. ``edgectl status``; then everything stops, router first. Exit 0 when all of it worked.

Clients are placed through ``X-Forwarded-For`` and the MaxMind *test* database in the source
tree; without it both clients count as local to the router and the Seattle one lands in London.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from edgeinfer.ctl.client import RouterClientError
from edgeinfer.ctl.local_cluster import TEST_GEOIP_DB, LocalCluster, free_port

SYSTEM = (
    "You are a helpful assistant served by edgeinfer, a network that runs language models in "
    "edge points of presence, close to their users, the way a CDN serves web pages."
)
# (where the client is, its address in the test database, messages, max_tokens)
CLIENTS = (
    ("London", "81.2.69.160", [{"role": "system", "content": SYSTEM},
                               {"role": "user", "content": "What does a CDN do, in one sentence?"}]),
    ("Milton, WA", "216.160.83.56", [{"role": "user", "content": "Name three primary colours."}]),
)  # fmt: skip


def stream_chat(
    cluster: LocalCluster, xff: str, messages: list[dict[str, str]], max_tokens: int
) -> dict[str, str]:
    """Print the answer as it streams in; return the response headers (lower-cased)."""
    conn = http.client.HTTPConnection("127.0.0.1", cluster.router_port, timeout=300)
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    headers = {"Content-Type": "application/json", "X-Forwarded-For": xff}
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), headers)
        resp = conn.getresponse()
        if resp.status != 200:
            raise RouterClientError(f"the router answered {resp.status}: {resp.read().decode()}")
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RouterClientError(f"the stream failed: {event['error']['message']}")
            for choice in event["choices"]:
                print(choice["delta"].get("content") or "", end="", flush=True)
        print()
        return {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


def router_reasoning(cluster: LocalCluster, xff: str) -> list[str]:
    """The candidates the router priced for the last request from ``xff``, best first."""
    marker = f"edgeinfer.router.proxy: /v1/chat/completions from {xff} "
    lines = [ln for ln in cluster.router.log.read_text().splitlines() if marker in ln]
    if not lines or ": decode " not in lines[-1]:
        return []
    names = {p.url: p.name for p in cluster.procs}
    candidates = "decode " + lines[-1].split(": decode ", 1)[1]
    for url, name in names.items():
        candidates = candidates.replace(url, name)
    return candidates.split(" | ")


def run(cluster: LocalCluster, max_tokens: int) -> None:
    started = time.monotonic()
    print(f"starting a router and {len(cluster.layout)} PoPs (logs in {cluster.workdir}) ...")
    cluster.start()
    cluster.wait_ready()
    print(f"up in {time.monotonic() - started:.0f}s:")
    for proc in cluster.procs:
        print(f"  {proc.name:16} {proc.url}")
    for where, xff, messages in CLIENTS:
        print(f"\n--- a client in {where} (X-Forwarded-For: {xff}) asks the router:")
        print(f"Q: {messages[-1]['content']}\nA: ", end="", flush=True)
        headers = stream_chat(cluster, xff, messages, max_tokens)
        decode, prefill = headers.get("x-edge-decode-pop"), headers.get("x-edge-prefill-pop")
        print(f"placement: decode in {decode}, prefill in {prefill}")
        reasons = router_reasoning(cluster, xff)
        if reasons:
            print("the router's estimates, best first (ms):")
            for reason in reasons:
                print(f"  {reason}")
    print("\n--- edgectl status")
    env = {
        **os.environ,
        "EDGEINFER_ROUTER": cluster.router_url,
        "EDGEINFER_ADMIN_TOKEN": cluster.token,
    }
    subprocess.run([sys.executable, "-m", "edgeinfer.ctl.main", "status"], env=env, check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="directory, 'tiny', or the built-in model")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="edgeinfer-demo-"))
    cluster = LocalCluster(
        workdir, secrets.token_urlsafe(16), model=args.model, router_port=free_port(),
        geoip_db=TEST_GEOIP_DB if TEST_GEOIP_DB.exists() else None, router_log_level="debug",
    )  # fmt: skip
    ok = False
    try:
        run(cluster, args.max_tokens)
        ok = True
    except (RouterClientError, subprocess.CalledProcessError, OSError) as exc:
        print(f"\ndemo failed: {exc}", file=sys.stderr)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
    finally:
        print("\nstopping: router first, then decode and prefill daemons ...")
        codes = cluster.stop()
    unclean = {name: code for name, code in codes.items() if code != 0}
    if unclean:
        print(f"processes exited uncleanly: {unclean}", file=sys.stderr)
    if ok and not unclean:
        print(f"all {len(codes)} processes stopped cleanly")
        shutil.rmtree(workdir, ignore_errors=True)
        return 0
    print(f"logs kept in {workdir}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
