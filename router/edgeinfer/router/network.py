"""How long bytes take between a client and a PoP, and between two PoPs.

Distances are great circles on a spherical Earth; round-trip times are the fibre floor for that
distance plus a fixed cost (last mile, switching, TLS record). Measurements only ever *raise* an
estimate: congestion shows in a measured RTT, but nothing beats light in glass, so a measurement
below the floor is a clock or geolocation error, not a shortcut.

The same numpy expressions serve single points and whole arrays, so the selector's vectorised
estimates and the scalars in a placement's breakdown cannot disagree.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
import numpy as np
import numpy.typing as npt

from edgeinfer.router.geo import Located
from edgeinfer.router.pop_registry import PopRegistry
from edgeinfer.shared.tasks import cancel_and_wait

log = logging.getLogger(__name__)

EARTH_RADIUS_KM = 6371.0088  # IUGG mean radius
FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.intp]


def unit_vectors(lat_deg: Any, lon_deg: Any) -> FloatArray:
    """Points on the unit sphere, shape ``(..., 3)``: a dot product then gives the angle."""
    lat, lon = np.radians(lat_deg), np.radians(lon_deg)
    return np.stack([np.cos(lat) * np.cos(lon), np.cos(lat) * np.sin(lon), np.sin(lat)], axis=-1)


def km_from_dot(dot: Any) -> Any:
    """Great-circle km from the dot product of two unit vectors (clipped against rounding)."""
    # Two ufuncs instead of np.clip, whose Python wrapper costs more than the work here.
    return np.arccos(np.minimum(np.maximum(dot, -1.0), 1.0)) * EARTH_RADIUS_KM


def great_circle_km(a: Located, b: Located) -> float:
    ua, ub = unit_vectors(a.lat, a.lon), unit_vectors(b.lat, b.lon)
    return float(km_from_dot(ua @ ub))


@dataclasses.dataclass(frozen=True)
class NetworkModel:
    """Latency and bandwidth assumptions; every field is in the unit its name says."""

    # Great-circle km per ms of *round trip*: light in glass covers ~200 km/ms each way.
    fibre_km_per_ms: float = 100.0
    # Added to every RTT between distinct places: last mile, queues, switching.
    fixed_rtt_ms: float = 2.0
    # Sustained bandwidth one KV transfer gets between two PoPs, and inside one (the router
    # prices an intra-PoP hop as free; the simulator moves the pages at this rate).
    inter_pop_gbps: float = 10.0
    intra_pop_gbps: float = 100.0
    # A client this close to the router's PoP shares the router's paths, so the router's own
    # RTT measurements to other PoPs apply to it too.
    catchment_km: float = 1000.0

    @property
    def inter_pop_bytes_per_s(self) -> float:
        return self.inter_pop_gbps * 1e9 / 8

    @property
    def intra_pop_bytes_per_s(self) -> float:
        return self.intra_pop_gbps * 1e9 / 8

    def kv_link_s(self, kv_bytes: Any, same_pop: bool = False) -> Any:
        """Seconds ``kv_bytes`` of KV pages spend on the link, between PoPs or inside one."""
        return kv_bytes / (self.intra_pop_bytes_per_s if same_pop else self.inter_pop_bytes_per_s)

    @staticmethod
    def kv_exposed_s(link_s: Any, compute_s: Any, tokens: Any, chunk_tokens: int) -> Any:
        """The part of a KV transfer of ``tokens`` prompt tokens not hidden behind the prefill
        computing them: pages of finished chunks stream while later chunks compute, the last
        chunk's cannot. Scalars or arrays that broadcast (the selector's hot path: scalars)."""
        if isinstance(tokens, np.ndarray):
            last_share: Any = np.minimum(1.0, chunk_tokens / np.maximum(tokens, 1))
        else:
            last_share = 1.0 if tokens <= chunk_tokens else chunk_tokens / tokens
        return np.maximum(link_s - compute_s, link_s * last_share)

    def rtt_floor_s(self, km: Any) -> Any:
        """RTT floor for great-circle distance(s) ``km``."""
        return (np.asarray(km) / self.fibre_km_per_ms + self.fixed_rtt_ms) * 1e-3

    @property
    def s_per_radian(self) -> float:
        """Seconds of RTT floor per radian of great circle."""
        return EARTH_RADIUS_KM / self.fibre_km_per_ms * 1e-3

    @property
    def fixed_rtt_s(self) -> float:
        """Seconds added to every RTT between distinct places."""
        return self.fixed_rtt_ms * 1e-3

    def rtt_floor_to_point_s(self, xyz: FloatArray, point: Sequence[float]) -> FloatArray:
        """RTT floor from each unit vector of ``xyz`` [N, 3] to the unit vector ``point`` (the
        selector's hot path: one per request)."""
        # The point shrunk a hair, so that every dot product is inside [-1, 1] without two
        # clipping passes: arccos(1 - 1e-12) is 9 metres.
        rtt = np.arccos(xyz @ np.multiply(point, 1.0 - 1e-12))
        rtt *= self.s_per_radian
        rtt += self.fixed_rtt_s
        return rtt

    def rtt_floor_from_dot_s(self, dot: Any) -> Any:
        """:meth:`rtt_floor_s` of :func:`km_from_dot`, folded into one multiply-add."""
        return np.arccos(np.minimum(np.maximum(dot, -1.0), 1.0)) * self.s_per_radian + (
            self.fixed_rtt_s
        )

    def in_catchment(self, client: Located, here: Located) -> bool:
        # catchment_km <= 0 switches measured RTTs off altogether.
        return self.catchment_km > 0 and great_circle_km(client, here) <= self.catchment_km

    def client_rtt_s(
        self, client: Located, pop: Located, here_pop: Located, measured_rtt: float | None
    ) -> float:
        """Expected RTT between a client and a PoP (see the module docstring for the rule)."""
        floor = float(self.rtt_floor_s(great_circle_km(client, pop)))
        if measured_rtt is not None and self.in_catchment(client, here_pop):
            return max(floor, measured_rtt)
        return floor

    def inter_pop_rtt_s(self, p: Located, d: Located) -> float:
        """RTT between two PoPs; 0 inside one PoP (a LAN hop is noise at this scale)."""
        if (p.lat, p.lon) == (d.lat, d.lon):
            return 0.0
        return float(self.rtt_floor_s(great_circle_km(p, d)))

    def kv_transfer_s(self, p: Located, d: Located, kv_bytes: float) -> float:
        """Time for ``kv_bytes`` of KV pages from P to D: a round trip (the prefill request goes
        out, the pages come back) plus the bytes over the link; nothing inside one PoP."""
        rtt = self.inter_pop_rtt_s(p, d)
        return 0.0 if rtt == 0.0 else rtt + kv_bytes / self.inter_pop_bytes_per_s


class PopGeometry:
    """PoP positions as unit vectors and the PoP-to-PoP RTT floor matrix (0 within a PoP)."""

    def __init__(self, pops: dict[str, tuple[float, float]], net: NetworkModel) -> None:
        self.index = {name: i for i, name in enumerate(pops)}
        lat_lon = np.asarray(list(pops.values()), dtype=np.float64).reshape(len(pops), 2)
        self.xyz: FloatArray = unit_vectors(lat_lon[:, 0], lat_lon[:, 1])
        rtt = np.asarray(net.rtt_floor_from_dot_s(self.xyz @ self.xyz.T))
        np.fill_diagonal(rtt, 0.0)  # as inter_pop_rtt_s: a LAN hop is noise at this scale
        self.rtt: FloatArray = rtt
        self.xyz_of = {name: self.xyz[i].tolist() for name, i in self.index.items()}


_geometry: tuple[dict[str, tuple[float, float]], NetworkModel, PopGeometry] | None = None


def pop_geometry(pops: dict[str, tuple[float, float]], net: NetworkModel) -> PopGeometry:
    """The geometry of ``pops`` (name -> lat, lon), cached: only a reload of the PoP table
    changes it, and its O(PoPs^2) matrix is too dear to rebuild on every heartbeat."""
    global _geometry
    if _geometry is None or _geometry[0] != pops or _geometry[1] != net:
        _geometry = (pops, net, PopGeometry(pops, net))
    return _geometry[2]


class RttProber:
    """Measures HTTP round trips from this router to one daemon per PoP, into the registry.

    A ``GET /health`` over a kept-alive connection costs one RTT plus the daemon's (tiny) handler
    time. The first probe of a connection also pays the TCP (and TLS) handshake, so it is thrown
    away. Failures record nothing: the proxy and the heartbeats judge liveness.
    """

    def __init__(
        self, registry: PopRegistry, interval_s: float, *, timeout_s: float | None = None
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.registry = registry
        self.interval_s = interval_s
        self.timeout_s = timeout_s if timeout_s is not None else min(interval_s, 5.0)
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._warm: set[str] = set()  # daemon URLs with a connection already open
        # Each PoP is probed through one daemon, kept while it answers so its connection stays
        # warm; a failure moves the probe to the PoP's next daemon.
        self._pick: dict[str, int] = {}

    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("RTT prober already started")
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=3 * self.interval_s),
        )
        self._task = asyncio.create_task(self._run(), name="rtt-prober")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def probe_all(self) -> None:
        """One round: every PoP with daemons, concurrently."""
        targets = [
            (pop.name, pop.daemons[self._pick.get(pop.name, 0) % len(pop.daemons)])
            for pop in self.registry.pops()
            if pop.daemons
        ]
        await asyncio.gather(*(self._probe(name, url) for name, url in targets))

    async def _probe(self, pop: str, url: str) -> None:
        if self._session is None:
            return
        try:
            for _ in range(1 if url in self._warm else 2):
                start = time.perf_counter()
                async with self._session.get(f"{url}/health") as resp:
                    await resp.read()
                elapsed = time.perf_counter() - start
        except (aiohttp.ClientError, TimeoutError) as e:
            self._warm.discard(url)
            self._pick[pop] = self._pick.get(pop, 0) + 1
            log.debug("RTT probe of %s failed: %s", url, e)
            return
        self._warm.add(url)
        self.registry.record_rtt(pop, elapsed)

    async def _run(self) -> None:
        while True:
            await self.probe_all()
            await asyncio.sleep(self.interval_s)
