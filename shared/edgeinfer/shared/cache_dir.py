"""Where edgeinfer keeps what it builds once per host: converted models, compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$EDGEINFER_CACHE_DIR``, else ``$XDG_CACHE_HOME/edgeinfer``, else ``~/.cache/edgeinfer``."""
    if env := os.environ.get("EDGEINFER_CACHE_DIR"):
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "edgeinfer"
