"""The key this router presents to its daemons (their ``api_key``), from ``daemon_api_key_file``.

A daemon with an ``api_key`` trusts the ``x-edge-*`` headers of a request only when it carries
``Authorization: Bearer <api_key>``, so the router sends it on everything it asks a daemon
(forwarded requests and discovery). The client's own ``Authorization`` never reaches a daemon.
The file is read at start-up and again on SIGHUP; a file that breaks on reload keeps the old key.
"""

from __future__ import annotations

import logging
from pathlib import Path

from edgeinfer.shared.errors import ConfigError

log = logging.getLogger(__name__)


class DaemonKey:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._headers: dict[str, str] = {}
        self._headers = self._read()

    def headers(self) -> dict[str, str]:
        """``{"Authorization": "Bearer ..."}``, or nothing when no key file is configured."""
        return self._headers

    def reload(self) -> None:
        try:
            self._headers = self._read()
        except ConfigError as e:
            log.error("SIGHUP: keeping the current daemon key: %s", e)

    def _read(self) -> dict[str, str]:
        if self.path is None:
            return {}
        try:
            key = self.path.read_text().strip()
        except OSError as e:
            raise ConfigError(
                f"cannot read daemon_api_key_file {self.path}: {e.strerror or e}"
            ) from e
        if not key or any(c.isspace() for c in key):
            raise ConfigError(f"daemon_api_key_file {self.path} must hold one key on one line")
        return {"Authorization": f"Bearer {key}"}
