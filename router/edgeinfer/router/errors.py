"""Errors the router raises on purpose.

Everything derives from :class:`RouterError`, itself an :class:`EdgeInferError`, so the router's
entry point can turn "we refused this" into a clean message and exit code while genuine bugs keep
their traceback.
"""

from edgeinfer.shared.errors import EdgeInferError


class RouterError(EdgeInferError):
    """A router operation was refused: unknown PoP or daemon name, invalid PoP table, bad CIDR.

    The message names the offending value so an operator can act on it without reading code.
    """
