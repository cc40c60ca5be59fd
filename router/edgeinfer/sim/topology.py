"""Where PoPs and clients are, and what each PoP runs.

PoPs are spread over metro areas in proportion to the metros' weight (people and PoPs go
together), each jittered so two PoPs of a metro are distinct places. A PoP has a GPU budget
split into prefill, decode and ``both`` (colocated) engines; the split is what ``edgectl plan``
searches.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence

from edgeinfer.sim import SimError


@dataclasses.dataclass(frozen=True, slots=True)
class Metro:
    name: str
    region: str
    lat: float
    lon: float
    utc_offset_h: float
    weight: float  # relative share of its region's clients


METROS: tuple[Metro, ...] = (
    Metro("new-york", "na", 40.71, -74.01, -5, 3.0),
    Metro("chicago", "na", 41.88, -87.63, -6, 1.5),
    Metro("dallas", "na", 32.78, -96.80, -6, 1.2),
    Metro("los-angeles", "na", 34.05, -118.24, -8, 2.0),
    Metro("seattle", "na", 47.61, -122.33, -8, 0.8),
    Metro("atlanta", "na", 33.75, -84.39, -5, 1.0),
    Metro("toronto", "na", 43.65, -79.38, -5, 1.0),
    Metro("mexico-city", "na", 19.43, -99.13, -6, 1.5),
    Metro("london", "eu", 51.51, -0.13, 0, 2.5),
    Metro("paris", "eu", 48.86, 2.35, 1, 1.8),
    Metro("frankfurt", "eu", 50.11, 8.68, 1, 1.8),
    Metro("amsterdam", "eu", 52.37, 4.90, 1, 1.0),
    Metro("madrid", "eu", 40.42, -3.70, 1, 1.0),
    Metro("milan", "eu", 45.46, 9.19, 1, 1.0),
    Metro("stockholm", "eu", 59.33, 18.07, 1, 0.6),
    Metro("warsaw", "eu", 52.23, 21.01, 1, 0.8),
    Metro("tokyo", "as", 35.68, 139.69, 9, 3.0),
    Metro("seoul", "as", 37.57, 126.98, 9, 1.5),
    Metro("shanghai", "as", 31.23, 121.47, 8, 2.0),
    Metro("hong-kong", "as", 22.32, 114.17, 8, 1.2),
    Metro("singapore", "as", 1.35, 103.82, 8, 1.5),
    Metro("mumbai", "as", 19.08, 72.88, 5.5, 2.5),
    Metro("delhi", "as", 28.61, 77.21, 5.5, 2.0),
    Metro("jakarta", "as", -6.21, 106.85, 7, 1.2),
    Metro("sao-paulo", "sa", -23.55, -46.63, -3, 2.0),
    Metro("buenos-aires", "sa", -34.60, -58.38, -3, 1.0),
    Metro("bogota", "sa", 4.71, -74.07, -5, 0.8),
    Metro("sydney", "oc", -33.87, 151.21, 10, 1.5),
    Metro("auckland", "oc", -36.85, 174.76, 12, 0.5),
    Metro("johannesburg", "af", -26.20, 28.05, 2, 1.0),
    Metro("lagos", "af", 6.52, 3.38, 1, 1.0),
    Metro("cairo", "af", 30.04, 31.24, 2, 1.0),
)
REGIONS: tuple[str, ...] = ("na", "eu", "as", "sa", "oc", "af")


@dataclasses.dataclass(frozen=True, slots=True)
class Split:
    """One PoP's GPUs: each GPU runs one engine of one role."""

    prefill: int
    decode: int
    both: int = 0

    def __post_init__(self) -> None:
        if min(self.prefill, self.decode, self.both) < 0 or self.decode + self.both < 1:
            raise SimError(f"a PoP needs >= 1 decode-capable GPU and no negative count: {self}")

    @property
    def gpus(self) -> int:
        return self.prefill + self.decode + self.both

    def label(self) -> str:
        return f"{self.prefill}P:{self.decode}D" + (f":{self.both}B" if self.both else "")


@dataclasses.dataclass(frozen=True, slots=True)
class SimPop:
    name: str
    region: str
    metro: str
    lat: float
    lon: float
    split: Split


@dataclasses.dataclass(frozen=True)
class Topology:
    pops: tuple[SimPop, ...]

    def __post_init__(self) -> None:
        if not self.pops:
            raise SimError("a topology needs at least one PoP")
        if len({p.name for p in self.pops}) != len(self.pops):
            raise SimError("PoP names must be unique")

    @property
    def gpus(self) -> int:
        return sum(p.split.gpus for p in self.pops)

    def with_splits(self, splits: Sequence[Split] | Split) -> Topology:
        """The same places with other splits: one for every PoP, or one per PoP."""
        per = [splits] * len(self.pops) if isinstance(splits, Split) else list(splits)
        if len(per) != len(self.pops):
            raise SimError(f"{len(per)} splits for {len(self.pops)} PoPs")
        pops = (dataclasses.replace(p, split=s) for p, s in zip(self.pops, per))
        return Topology(tuple(pops))


def build_topology(
    n_pops: int, split: Split, regions: Sequence[str] = REGIONS, seed: int = 0
) -> Topology:
    """``n_pops`` PoPs over the metros of ``regions``, largest-remainder by metro weight."""
    metros = [m for m in METROS if m.region in regions]
    if n_pops < 1 or not metros:
        raise SimError(f"need >= 1 PoP over known regions, got {n_pops} over {list(regions)}")
    total = sum(m.weight for m in metros)
    quota = [n_pops * m.weight / total for m in metros]
    counts = [math.floor(q) for q in quota]
    for i in sorted(range(len(metros)), key=lambda i: counts[i] - quota[i])[: n_pops - sum(counts)]:
        counts[i] += 1
    rng = random.Random(seed)
    pops = []
    for metro, count in zip(metros, counts):
        for k in range(count):
            # The first PoP of a metro sits on it; the others within ~300 km (suburbs, peers).
            lat = metro.lat + (rng.uniform(-2.5, 2.5) if k else 0.0)
            lon = metro.lon + (rng.uniform(-2.5, 2.5) if k else 0.0)
            name = f"{metro.name}-{k}"
            pops.append(SimPop(name, metro.region, metro.name, max(-89.0, min(89.0, lat)),
                               (lon + 180) % 360 - 180, split))  # fmt: skip
    return Topology(tuple(pops))
