"""``x-session-affinity: ID`` (Cloudflare's header): keep a client's session on one daemon when
the router has no prefix knowledge to do it with (no tokenizer fetched yet, a prompt it cannot
read as the daemon will).

Consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam, SODA 2018): the
decode daemons of a PoP (the one placement prefers for the client: affinity holds within a
location, never across the world) sit on a ring (:data:`POINTS` points each, so one leaving moves only its own
sessions), a session goes to the first daemon clockwise of its hash whose load is within
``1 + eps`` of the mean, so a heavy session cannot build a hot spot. The session is hashed with
the tenant: one tenant's IDs can neither choose nor reveal where another's go. It is a hint: a
daemon over the ITL SLO or full is passed over like any other.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from edgeinfer.router.prefix_scoring import under_bound

AFFINITY_HEADER = "x-session-affinity"
MAX_ID_CHARS = 256  # a longer value is ignored, not an error: it is only a hint
POINTS = 16  # ring points per daemon


def affinity_key(tenant: str, session_id: str | None) -> int:
    """The session's place on the ring (0: no usable header)."""
    if not session_id or len(session_id) > MAX_ID_CHARS:
        return 0
    h = hashlib.blake2b(digest_size=8, person=b"edge-affinity")
    for part in (tenant, session_id):
        raw = part.encode(errors="surrogatepass")
        h.update(len(raw).to_bytes(4, "big") + raw)
    return int.from_bytes(h.digest(), "big") or 1


class AffinityRing:
    """The ring of one set of decode daemons (built once per load snapshot: they are stable)."""

    def __init__(self, urls: Sequence[str]) -> None:
        points, owners = [], []
        for i, url in enumerate(urls):
            for k in range(POINTS):
                d = hashlib.blake2b(f"{url}#{k}".encode(), digest_size=8).digest()
                points.append(int.from_bytes(d, "big"))
                owners.append(i)
        order = np.argsort(np.asarray(points, dtype=np.uint64), kind="stable")
        self._points = np.asarray(points, dtype=np.uint64)[order]
        self._owners: list[int] = np.asarray(owners, dtype=np.intp)[order].tolist()

    def pick(self, key: int, load: Sequence[float], eps: float) -> int | None:
        """Index of the session's daemon: the first clockwise within the bound (None: empty)."""
        if not self._owners:
            return None
        ok = under_bound(np.asarray(load, dtype=np.float64), 1.0, eps).tolist()
        n = len(self._owners)
        start = int(self._points.searchsorted(np.uint64(key)))
        for step in range(n):
            owner = self._owners[(start + step) % n]
            if ok[owner]:
                return owner
        return None  # unreachable: under_bound is never all False
