"""The router's compiled passes: numba, with a disk cache that cannot serve stale code.

numba stamps a cached function by its own source file's modification time and size, and keys it
by its own bytecode. A pass also carries what it was compiled with from other modules: the
compiled functions it calls (``place_prefix`` calls ``prefix_pairs.search``) and the column
numbers it reads as constants (``load_columns``). Change one of those alone and numba would load
the old machine code; so would a reinstall that keeps the files' times and sizes (a wheel built
with ``SOURCE_DATE_EPOCH``). Every pass's cache is therefore also stamped with a digest of this
package's sources: any change to them compiles every pass again, once (~15-20 s at a start).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from numba import njit

PACKAGE = Path(__file__).resolve().parent


def sources_digest(directory: Path) -> str:
    """A digest of the ``*.py`` files in ``directory``, names and contents."""
    h = hashlib.sha256()
    for path in sorted(directory.glob("*.py")):
        h.update(path.name.encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


@functools.cache
def package_digest() -> str:
    """:func:`sources_digest` of this package, read once a process."""
    return sources_digest(PACKAGE)


def compiled(fn: Callable[..., Any]) -> Any:
    """``fn`` compiled by numba, its code cached on disk (beside this file, in the user's cache or
    in ``NUMBA_CACHE_DIR``) under the package's digest (module doc). Where no cache location is
    writable numba refuses the cache at import, and where this numba keeps its stamp elsewhere
    the cache is not used: the passes are then compiled at every start instead."""
    try:
        dispatcher = njit(cache=True, nogil=True, boundscheck=False)(fn)
    except RuntimeError:
        return njit(nogil=True, boundscheck=False)(fn)
    index = getattr(getattr(dispatcher, "_cache", None), "_cache_file", None)
    if index is None or not hasattr(index, "_source_stamp"):
        return njit(nogil=True, boundscheck=False)(fn)
    index._source_stamp = (index._source_stamp, package_digest())
    return dispatcher
