"""One registry snapshot as placement sees it: its PoP geometry and, per model, its
:class:`~edgeinfer.router.load_arrays.LoadArrays`, kept in the snapshot (``Snapshot.derived``)
and carried over to the next one when only load changed (``Snapshot.base``)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from edgeinfer.router.inflight import PlacementLedger
from edgeinfer.router.load_arrays import LoadArrays
from edgeinfer.router.network import EARTH_RADIUS_KM, NetworkModel, PopGeometry, pop_geometry
from edgeinfer.router.placement import PlacementConfig
from edgeinfer.router.pop_registry import DaemonView, Snapshot


class Prepared:
    """One snapshot: its PoP geometry and, per model, its :class:`LoadArrays`."""

    def __init__(
        self, views: Sequence[DaemonView], net: NetworkModel, cfg: PlacementConfig,
        pending: PlacementLedger | None, base: Prepared | None = None,
        changed: frozenset[str] = frozenset(),
    ) -> None:  # fmt: skip
        """``base``: the previous snapshot's, which differs from ``views`` only in the load of
        the daemons ``changed`` (their availability, roles and models are the same): its
        geometry is kept and its arrays are carried over (:meth:`LoadArrays.carry`)."""
        self.views, self.net, self.cfg, self.pending = list(views), net, cfg, pending
        self.geo: PopGeometry
        self.catchment_dot: float
        self.default_model: str | None
        self._by_model: dict[str, LoadArrays] = {}
        self._carried: dict[str, LoadArrays] = {}
        self._changed: list[DaemonView] = []
        if base is not None:
            self.geo, self.catchment_dot = base.geo, base.catchment_dot
            self.default_model = base.default_model
            self._carried = base._by_model
            base._by_model = {}  # they move: the old snapshot builds its own if asked again
            self._changed = [v for v in self.views if v.url in changed]
            return
        self.geo = pop_geometry({v.pop: (v.lat, v.lon) for v in views}, net)
        # Clients whose dot product with the router's PoP exceeds this are in its catchment.
        # (> 1, so nobody, when catchment_km <= 0 switches measured RTTs off.)
        self.catchment_dot = (
            math.cos(net.catchment_km / EARTH_RADIUS_KM) if net.catchment_km > 0 else 2.0
        )
        counts = Counter(v.model for v in views if v.available and v.model and v.role != "prefill")
        # Ties broken by name so every router picks the same default.
        self.default_model = min(counts, key=lambda m: (-counts[m], m)) if counts else None

    def arrays(self, model: str, now: float | None) -> LoadArrays:
        a = self._by_model.get(model)
        pending = self.pending
        c = self._carried.pop(model, None) if a is None else None
        if c is not None and c.carry(self._changed, now):
            a = self._by_model[model] = c
        changes = pending.changes_since(a.version) if a is not None and pending else []
        if a is None or changes is None:  # new, or the journal was trimmed: from the totals
            a = LoadArrays(self.views, model, self.geo, self.cfg, pending, now)
            self._by_model[model] = a
        elif changes and pending is not None:
            a.apply(changes, pending.version)
        if pending is not None:
            pending.trim_to(min(x.version for x in self._by_model.values()))
        return a


_PREPARED = "placement"  # the key of a Snapshot's derived entry


def prepared(
    views: Sequence[DaemonView], net: NetworkModel, cfg: PlacementConfig,
    pending: PlacementLedger | None,
) -> Prepared:  # fmt: skip
    """The snapshot's :class:`Prepared`, kept in the registry's :class:`Snapshot` (a plain
    sequence of views gets a fresh one: nothing says it will not change)."""
    cache = views.derived if isinstance(views, Snapshot) else None
    s = cache.get(_PREPARED) if cache is not None else None
    if isinstance(s, Prepared) and _same(s, net, cfg, pending):
        return s
    base, changed = None, frozenset[str]()
    if isinstance(views, Snapshot):
        b = views.base.derived.get(_PREPARED) if views.base is not None else None
        if isinstance(b, Prepared) and views.changed is not None and _same(b, net, cfg, pending):
            base, changed = b, views.changed
        views.base = None  # carried or not, the chain of snapshots ends here
    prep = Prepared(views, net, cfg, pending, base, changed)
    if cache is not None:
        cache[_PREPARED] = prep
    return prep


def _same(
    p: Prepared, net: NetworkModel, cfg: PlacementConfig, pending: PlacementLedger | None
) -> bool:
    # `in` tests identity before equality, which for a dataclass builds tuples: the proxy
    # passes the same objects every time.
    return p.net in (net,) and p.cfg in (cfg,) and p.pending is pending
