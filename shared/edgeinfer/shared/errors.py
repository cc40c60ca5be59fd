"""Exceptions shared by every edgeinfer process.

:class:`EdgeInferError` is the project-wide base so that an entry point can catch "anything we
raised on purpose" in one clause and let genuine bugs (``TypeError``, ``KeyError``...) surface
with a traceback.
"""


class EdgeInferError(Exception):
    """Base class of every error edgeinfer raises on purpose."""


class ConfigError(EdgeInferError):
    """The configuration is invalid: unreadable file, unknown key, or a value of the wrong type.

    The message always names the offending key and where the value came from (file, environment
    variable or command-line flag) so an operator can fix it without reading code.
    """
