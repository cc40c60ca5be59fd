"""``edgectl cluster up``: a long-running edgeinfer network on this machine, to play with.

One prefill PoP (Frankfurt) and two decode PoPs (London, Seattle) behind a router on
``--port``; every process is real and logs to ``--workdir``. It runs until Ctrl-C (or SIGTERM),
then stops the router first and the daemons after it, each draining what it still serves.
"""

from __future__ import annotations

import secrets
import signal
import tempfile
import threading
from pathlib import Path
from types import FrameType

import click

from edgeinfer.ctl.client import RouterClientError
from edgeinfer.ctl.local_cluster import TEST_GEOIP_DB, LocalCluster


def _wait_for_signal() -> None:
    """Block until SIGINT or SIGTERM."""
    stop = threading.Event()

    def handle(signum: int, frame: FrameType | None) -> None:
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handle)
    while not stop.wait(0.5):  # a timed wait: an untimed one would delay the handler
        pass


def print_hints(cluster: LocalCluster) -> None:
    url = cluster.router_url
    click.echo(f"\nedgeinfer is up: router {url}, logs in {cluster.workdir}")
    for proc in cluster.procs:
        click.echo(f"  {proc.name:16} {proc.url}")
    click.echo("\nTry:")
    click.echo(f"  export EDGEINFER_ROUTER={url} EDGEINFER_ADMIN_TOKEN={cluster.token}")
    click.echo("  edgectl status")
    xff = " -H 'X-Forwarded-For: 216.160.83.56'" if cluster.geoip_db else ""
    click.echo(
        f"  curl -sN {url}/v1/chat/completions -H 'Content-Type: application/json'{xff} -d "
        """'{"messages": [{"role": "user", "content": "Hello!"}], "stream": true}' -i"""
    )
    if cluster.geoip_db:
        click.echo("  (X-Forwarded-For picks the client's place: 81.2.69.160 is London,")
        click.echo("   216.160.83.56 Milton WA, 175.16.199.0 Changchun; see the x-edge-* headers)")
    click.echo("  edgectl drain lhr --wait; edgectl undrain lhr")
    click.echo("\nCtrl-C stops the cluster.")


@click.group()
def cluster() -> None:
    """Run edgeinfer networks on this machine."""


@cluster.command()
@click.option("--model", help='Checkpoint directory or "tiny"; default: the built-in model.')
@click.option("--port", default=8080, show_default=True, help="The router's port.")
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Config, admin token and logs; default: a new temporary directory.",
)
@click.option("--timeout", default=600.0, show_default=True, help="Seconds to wait for start.")
def up(model: str | None, port: int, workdir: Path | None, timeout: float) -> None:
    """Start a router, a prefill PoP and two decode PoPs on 127.0.0.1; Ctrl-C stops them."""
    where = workdir or Path(tempfile.mkdtemp(prefix="edgeinfer-cluster-"))
    geoip = TEST_GEOIP_DB if TEST_GEOIP_DB.exists() else None
    local = LocalCluster(
        where, secrets.token_urlsafe(16), model=model, router_port=port, geoip_db=geoip
    )
    click.echo(f"starting {len(local.layout)} PoPs and a router (logs in {where}) ...")
    try:
        local.start()
        local.wait_ready(timeout)
        print_hints(local)
        _wait_for_signal()
        click.echo("stopping ...")
    except KeyboardInterrupt:  # Ctrl-C while starting
        click.echo("stopping ...")
    finally:
        # A second Ctrl-C must not cut the shutdown short and leave processes behind.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        codes = local.stop()
    failed = {name: code for name, code in codes.items() if code != 0}
    if failed:
        raise RouterClientError(f"processes exited uncleanly: {failed} (logs in {where})")
    click.echo("stopped")
