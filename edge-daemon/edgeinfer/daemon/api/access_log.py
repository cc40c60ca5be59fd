"""The daemon's access line (:mod:`edgeinfer.shared.access_log`) with ``tenant=``: the tenant
the router vouched for. It is the one on the request's
:class:`~edgeinfer.daemon.api.caller.Caller`, so a claim the daemon did not believe (a refused
key) never reaches the log."""

from __future__ import annotations

from aiohttp.web import BaseRequest

from edgeinfer.daemon.api.caller import CALLER_KEY
from edgeinfer.shared.access_log import RequestAccessLog


class AccessLog(RequestAccessLog):
    def fields(self, request: BaseRequest) -> dict[str, str]:
        caller = request.get(CALLER_KEY)
        return {"tenant": (caller.tenant if caller is not None else None) or "-"}
