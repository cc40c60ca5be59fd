"""``edgectl drain POP`` / ``edgectl undrain POP``: the L7 step around an anycast withdrawal.

Draining tells the router to place no new request on the PoP (and the router passes the drain
on to the PoP's daemons, so every other router sees it in their state too); streams already
running finish. ``--wait`` returns once nothing is in flight there, which is when withdrawing
the PoP's route no longer cuts anyone off.
"""

from __future__ import annotations

import time

import click

from edgeinfer.ctl.client import AdminClient, RouterClientError, router_options


def _requests(n: int) -> str:
    return f"{n} request{'' if n == 1 else 's'}"


@click.command()
@click.argument("pop")
@click.option("--wait", is_flag=True, help="Return only once no request is in flight there.")
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=600.0,
    show_default=True,
    help="With --wait: give up (exit 1) after this many seconds.",
)
@click.option(
    "--poll-interval",
    type=click.FloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    hidden=True,
)
@router_options
def drain(
    pop: str,
    wait: bool,
    timeout: float,
    poll_interval: float,
    router_url: str,
    token: str | None,
) -> None:
    """Stop placing new requests on POP; running streams finish."""
    client = AdminClient(router_url, token)
    body = client.drain_pop(pop)
    in_flight = int(body["in_flight"])
    click.echo(f"{pop}: draining, {_requests(in_flight)} in flight")
    for url, error in sorted(body.get("daemon_errors", {}).items()):
        click.echo(f"{pop}: warning: daemon {url} was not told to drain: {error}", err=True)
    if not wait:
        return
    deadline = time.monotonic() + timeout
    while in_flight > 0:
        if time.monotonic() >= deadline:
            raise RouterClientError(
                f"{pop}: still {_requests(in_flight)} in flight after {timeout:g}s"
            )
        time.sleep(poll_interval)
        in_flight = int(client.pop(pop)["in_flight"])
    click.echo(f"{pop}: drained, no requests in flight")


@click.command()
@click.argument("pop")
@router_options
def undrain(pop: str, router_url: str, token: str | None) -> None:
    """Place requests on POP again."""
    AdminClient(router_url, token).undrain_pop(pop)
    click.echo(f"{pop}: accepting requests")
