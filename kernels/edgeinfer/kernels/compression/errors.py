"""Errors of the weight-compression package.

Kept free of torch and numpy imports so that light callers (the ``edgectl`` CLI, which must not
import torch at module level) can catch these exceptions without loading the codec.
"""


class CompressionError(Exception):
    """Base class of every error the compression package raises on purpose."""


class CorruptDataError(CompressionError):
    """Stored compressed data fails its checksum or is structurally invalid.

    Raised instead of returning weights, so a damaged file never yields garbage tensors.
    """


class UnsupportedFormatError(CompressionError):
    """The file uses a format version or a tensor dtype this code does not handle."""
