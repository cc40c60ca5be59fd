"""The daemon's access log: aiohttp's line plus the tenant the router vouched for.

The fields of :data:`~edgeinfer.shared.logs.ACCESS_LOG_FORMAT` (client, request line, status,
bytes, seconds, user agent), then ``tenant=``; the request id comes with every log line of the
request (:mod:`edgeinfer.shared.request_ids`). The tenant is the one on the request's
:class:`~edgeinfer.daemon.api.caller.Caller`, so a claim the daemon did not believe (a refused
key) never reaches the log. In the ``kv`` and ``json`` formats each field is also its own key.
"""

from __future__ import annotations

import logging

from aiohttp.abc import AbstractAccessLogger
from aiohttp.web import BaseRequest, StreamResponse

from edgeinfer.daemon.api.caller import CALLER_KEY


class AccessLog(AbstractAccessLogger):
    def log(self, request: BaseRequest, response: StreamResponse, time: float) -> None:
        caller = request.get(CALLER_KEY)
        tenant = (caller.tenant if caller is not None else None) or "-"
        agent = request.headers.get("User-Agent", "-")
        major, minor = request.version
        line = f"{request.method} {request.path_qs} HTTP/{major}.{minor}"
        self.logger.info(
            '%s "%s" %d %d %.6fs "%s" tenant=%s',
            request.remote,
            line,
            response.status,
            response.body_length,
            time,
            agent,
            tenant,
            extra={
                "remote_address": request.remote,
                "first_request_line": line,
                "response_status": response.status,
                "response_size": response.body_length,
                "request_time": time,
                "user_agent": agent,
                "tenant": tenant,
            },
        )

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.INFO)
