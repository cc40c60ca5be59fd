"""The router's access line (:mod:`edgeinfer.shared.access_log`) with ``tenant=`` (whose API key
the Gate admitted, ``-`` without keys or before the Gate) and ``decode_pop=`` (the PoP whose
decode daemon answered, ``-`` when none did: the router's own answers and refusals)."""

from __future__ import annotations

from aiohttp.web import BaseRequest

from edgeinfer.router.request_context import CONTEXT_KEY
from edgeinfer.shared.access_log import RequestAccessLog


class AccessLog(RequestAccessLog):
    def fields(self, request: BaseRequest) -> dict[str, str]:
        ctx = request.get(CONTEXT_KEY)  # None: refused before the middlewares ran
        tenant, pop = (ctx.tenant, ctx.pop) if ctx is not None else ("", "")
        return {"tenant": tenant or "-", "decode_pop": pop or "-"}
