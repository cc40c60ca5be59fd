"""Entry point of ``edgectl``: the click group and its single exit path for errors.

Commands raise the packages' own errors; :class:`EdgectlGroup` turns each into one red line on
stderr and exit status 1, so no command prints a traceback for an expected failure. Nothing
here imports torch: commands import heavy modules inside their bodies.
"""

from __future__ import annotations

from typing import Any

import click
from rich.console import Console
from rich.text import Text

from edgeinfer.ctl.client import RouterClientError, global_router_options
from edgeinfer.kernels.compression.errors import CompressionError
from edgeinfer.shared.errors import ConfigError

# Expected failures: reported in one line. Anything else is a bug and keeps its traceback.
USER_ERRORS: tuple[type[Exception], ...] = (
    CompressionError, RouterClientError, ConfigError, OSError,
)  # fmt: skip


class EdgectlGroup(click.Group):
    """A click group that reports the expected errors of any subcommand the same way."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except USER_ERRORS as exc:
            # One line whatever the width (soft_wrap); Text(), not markup: messages hold paths
            # and tensor names with brackets.
            Console(stderr=True, soft_wrap=True).print(Text(f"error: {exc}", style="bold red"))
            ctx.exit(1)


@click.group(cls=EdgectlGroup)
@global_router_options
def cli() -> None:
    """Operate edgeinfer deployments.

    --router and --token may come before the command (edgectl --router URL drain POP) or
    after it; given in both places, the command's own wins.
    """


def _register() -> None:
    from edgeinfer.ctl.cluster import cluster
    from edgeinfer.ctl.compress import compress, decompress
    from edgeinfer.ctl.drain import drain, undrain
    from edgeinfer.ctl.keys import keys
    from edgeinfer.ctl.plan import plan
    from edgeinfer.ctl.sim import sim
    from edgeinfer.ctl.status import status

    cli.add_command(compress)
    cli.add_command(decompress)
    cli.add_command(status)
    cli.add_command(drain)
    cli.add_command(undrain)
    cli.add_command(sim)
    cli.add_command(plan)
    cli.add_command(cluster)
    cli.add_command(keys)


_register()


if __name__ == "__main__":
    cli()
