"""The access line both servers write: one per request, after its response.

``CLIENT "METHOD PATH HTTP/x.y" STATUS BYTES SECONDSs "USER-AGENT"``, then what the server knows
of the request as ``key=value`` (the daemon: the tenant the router vouched for; the router: the
tenant its key belongs to and the PoP that answered). No time stamp: every log format already
stamps the record. In the ``kv`` and ``json`` formats each field is also its own key. The
request id comes with every line of the request (:mod:`edgeinfer.shared.request_ids`).

aiohttp's own ``AccessLogger`` would parse a format string for the first part; this formats it
directly, and a subclass adds its fields with :meth:`RequestAccessLog.fields`.
"""

from __future__ import annotations

import logging

from aiohttp.abc import AbstractAccessLogger
from aiohttp.web import BaseRequest, StreamResponse


class RequestAccessLog(AbstractAccessLogger):
    def fields(self, request: BaseRequest) -> dict[str, str]:
        """The server's own fields of ``request``, in order (none here)."""
        return {}

    def log(self, request: BaseRequest, response: StreamResponse, time: float) -> None:
        agent = request.headers.get("User-Agent", "-")
        major, minor = request.version
        line = f"{request.method} {request.path_qs} HTTP/{major}.{minor}"
        own = self.fields(request)
        self.logger.info(
            '%s "%s" %d %d %.6fs "%s"%s',
            request.remote,
            line,
            response.status,
            response.body_length,
            time,
            agent,
            "".join(f" {k}={v}" for k, v in own.items()),
            extra={
                "remote_address": request.remote,
                "first_request_line": line,
                "response_status": response.status,
                "response_size": response.body_length,
                "request_time": time,
                "user_agent": agent,
                **own,
            },
        )

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.INFO)
