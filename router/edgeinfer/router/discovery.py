"""Learning what each configured daemon is, from the daemon itself.

The config file lists only daemon URLs per PoP; role, model, KV endpoint and heartbeat endpoint
come from each daemon's ``GET /v1/state``, so they cannot drift from what the daemon really
runs. A daemon that does not answer (not started yet, still loading its model, a network
blip) is polled again every ``interval_s`` until it does; from then on its heartbeats, on the
endpoint it named, keep the registry current. :meth:`Discovery.sync` re-runs all of it after a
SIGHUP reload: new daemons are polled, removed ones are unsubscribed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import aiohttp
import orjson
import zmq

from edgeinfer.router.daemon_key import DaemonKey
from edgeinfer.router.heartbeat_listener import HeartbeatListener
from edgeinfer.router.pop_registry import PopConfig

log = logging.getLogger(__name__)

_STATE_TIMEOUT = aiohttp.ClientTimeout(total=3.0)


@dataclass(frozen=True)
class DaemonIdentity:
    """What a daemon's ``/v1/state`` says about itself (load is left to heartbeats)."""

    url: str
    pop: str
    role: str
    model: str
    kv_endpoint: str | None
    heartbeat_endpoint: str


class Discovery:
    def __init__(
        self,
        listener: HeartbeatListener,
        session: aiohttp.ClientSession,
        interval_s: float,
        daemon_key: DaemonKey | None = None,
    ) -> None:
        self._listener = listener
        self._session = session
        self._interval_s = interval_s
        # Daemons with an api_key may require it on /v1/state as on the rest of /v1.
        self._daemon_key = daemon_key
        self._configured: dict[str, str] = {}  # daemon URL -> the PoP the config puts it in
        self.identities: dict[str, DaemonIdentity] = {}
        self._recheck: set[str] = set()  # known daemons to ask again (after a reload)
        self._unreachable: set[str] = set()  # already logged at INFO; retries log at DEBUG
        self._wake = asyncio.Event()

    def sync(self, pops: tuple[PopConfig, ...]) -> None:
        """Adopt a (new) PoP list: forget removed daemons, ask every other one again.

        Known daemons stay subscribed while they are asked again, so a reload never opens a
        gap in their heartbeats; only a changed heartbeat endpoint is re-subscribed.
        """
        self._configured = {url: pop.name for pop in pops for url in pop.daemons}
        for url in [u for u in self.identities if u not in self._configured]:
            self._forget(url)
        self._recheck = set(self.identities)
        self._wake.set()

    def pending(self) -> list[str]:
        """Configured daemons whose ``/v1/state`` has not answered (since the last reload)."""
        return [u for u in self._configured if u not in self.identities or u in self._recheck]

    async def run(self) -> None:
        """Poll every undiscovered daemon each ``interval_s`` (sooner after :meth:`sync`)."""
        while True:
            self._wake.clear()
            pending = self.pending()
            if pending:
                await asyncio.gather(*(self._discover(url) for url in pending))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._interval_s)

    async def _discover(self, url: str) -> None:
        try:
            headers = self._daemon_key.headers() if self._daemon_key is not None else None
            state_url = url + "/v1/state"
            async with self._session.get(
                state_url, headers=headers, timeout=_STATE_TIMEOUT
            ) as resp:
                if resp.status != 200:
                    log.info("daemon %s: /v1/state answered %d; will retry", url, resp.status)
                    return
                state = orjson.loads(await resp.read())
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as e:
            level = logging.DEBUG if url in self._unreachable else logging.INFO
            self._unreachable.add(url)
            log.log(level, "daemon %s not reachable yet (%s); will retry", url, type(e).__name__)
            return
        self._unreachable.discard(url)
        identity = _identity(url, state)
        if identity is None:
            log.warning("daemon %s: /v1/state lacks role/model/heartbeat_endpoint: %s", url, state)
            return
        pop = self._configured.get(url)
        if pop is None:
            return  # removed by a reload while we were asking
        if identity.pop != pop:
            # The config decides placement; a mismatch is most likely a copy-paste slip.
            log.warning("daemon %s says it is in PoP %r, config says %r", url, identity.pop, pop)
        old = self.identities.get(url)
        self._recheck.discard(url)
        if old == identity:
            return
        try:
            self._listener.subscribe(identity.heartbeat_endpoint)
        except zmq.ZMQError as e:
            log.warning(
                "daemon %s: cannot subscribe to %s: %s", url, identity.heartbeat_endpoint, e
            )
            return
        self.identities[url] = identity
        if old is not None:
            self._release(old.heartbeat_endpoint)
        log.info(
            "daemon %s: %s %s, heartbeats %s, kv %s",
            url,
            identity.role,
            identity.model,
            identity.heartbeat_endpoint,
            identity.kv_endpoint,
        )

    def _forget(self, url: str) -> None:
        self._release(self.identities.pop(url).heartbeat_endpoint)

    def _release(self, endpoint: str) -> None:
        """Unsubscribe ``endpoint`` unless another known daemon still publishes there."""
        if all(i.heartbeat_endpoint != endpoint for i in self.identities.values()):
            self._listener.unsubscribe(endpoint)


def _identity(url: str, state: object) -> DaemonIdentity | None:
    if not isinstance(state, dict):
        return None
    fields = ("pop", "role", "model", "heartbeat_endpoint")
    if not all(isinstance(state.get(k), str) and state[k] for k in fields):
        return None
    kv = state.get("kv_endpoint")
    return DaemonIdentity(
        url=url,
        pop=state["pop"],
        role=state["role"],
        model=state["model"],
        kv_endpoint=kv if isinstance(kv, str) and kv else None,
        heartbeat_endpoint=state["heartbeat_endpoint"],
    )
