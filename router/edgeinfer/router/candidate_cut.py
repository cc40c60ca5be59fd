"""The decode daemons worth pricing, and their best pooled prefill, in compiled passes.

A decision prices a handful of decode daemons exactly (:mod:`edgeinfer.router.selector`), the
``k`` with the least network RTT floor from the client plus static key (SLO penalty, admission,
cheapest prefill for a reference prompt: :class:`~edgeinfer.router.load_arrays.LoadArrays`).
Finding them looks at every decode daemon; done as a dozen numpy calls over a few hundred
entries, each call's fixed cost dominated a decision. One compiled pass prunes instead: the
chord between two unit vectors is never longer than their arc, so ``sqrt(2 - 2 dot)`` bounds the
RTT floor from below without an ``acos``, and a daemon whose bound already loses to the ``k``-th
best so far is skipped. Only the daemons that can enter the ``k`` best pay for the exact floor.

The RTT floor is :meth:`NetworkModel.rtt_floor_to_point_s`'s: ``acos(dot) * s_per_radian +
fixed_rtt_s``, with the router's measured RTT to the daemon's PoP when that is larger (a client
in the router's catchment). A test holds the two to the same figures.

Compiled on first use and cached on disk (:mod:`edgeinfer.router.jit`); the router warms them
when it starts (:func:`warm`) so that no request waits for the compiler.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from edgeinfer.router.jit import compiled
from edgeinfer.router.load_columns import DState, PState, Row
from edgeinfer.router.network import FloatArray, IntArray, NetworkModel

# A chord equal to its arc (a daemon where the client is) may round a hair above the exact
# floor: bounds within this of the k-th best are computed exactly rather than skipped.
_SLACK_S = 1e-9


# Row's and DState's fields as plain ints, constants to the compiler.
_FREE, _WAIT, _L_END, _L_SPT = (int(Row.FREE_TOKENS), int(Row.ADMIT_WAIT_S), int(Row.LOCAL_END),
                                int(Row.LOCAL_S_PER_TOKEN))  # fmt: skip
_L_MAX, _C_END, _C_SPT = int(Row.LOCAL_MAX_TOKENS), int(Row.COLO_END), int(Row.COLO_S_PER_TOKEN)
_PENALTY, _ITL = int(Row.PENALTY), int(Row.ITL_S)
_X, _Y, _Z, _MEASURED = int(DState.X), int(DState.Y), int(DState.Z), int(DState.MEASURED_RTT_S)
_P_END, _P_SPT = int(PState.END), int(PState.S_PER_TOKEN)
# The pruning keys' columns, as the passes take them: an IntEnum argument costs the compiled
# function's dispatcher ~25 us to type, an int a fraction of one.
KEY_SHORT, KEY_LONG = int(DState.KEY_SHORT), int(DState.KEY_LONG)


@njit(inline="always")
def _dot(d: FloatArray, i: int, px: float, py: float, pz: float) -> float:
    """Row ``i``'s unit vector dotted with the client's, inside [-1, 1]."""
    return min(max(d[i, _X] * px + d[i, _Y] * py + d[i, _Z] * pz, -1.0), 1.0)


@njit(inline="always")
def _rtt(
    d: FloatArray, i: int, dot: float, scale: float, fixed: float, use_measured: bool
) -> float:
    """Row ``i``'s RTT from ``dot``: NetworkModel.rtt_floor_to_point_s's floor, or the RTT
    measured to its PoP when that is larger and counts (a client in the catchment)."""
    r = math.acos(dot) * scale + fixed
    return d[i, _MEASURED] if use_measured and d[i, _MEASURED] > r else r


@compiled
def rtt_of(
    d: FloatArray, i: int, px: float, py: float, pz: float, scale: float, fixed: float,
    use_measured: bool,
) -> float:  # fmt: skip
    """Row ``i``'s RTT alone, as :func:`cheapest` gives it (a prefix holder outside the cut)."""
    return _rtt(d, i, _dot(d, i, px, py, pz), scale, fixed, use_measured)


@compiled
def cheapest(
    d: FloatArray, key: int, px: float, py: float, pz: float, scale: float, fixed: float,
    use_measured: bool, k: int,
) -> tuple[IntArray, FloatArray]:  # fmt: skip
    """Rows of the ``min(k, len(d))`` daemons with the least ``RTT floor + d[:, key]``,
    cheapest first (ties: the lower row), and their RTTs. ``d`` is ``LoadArrays.d_state``
    [D, DState]; (``px``, ``py``, ``pz``) the client's unit vector, shrunk (ClientRtt)."""
    n = d.shape[0]
    k = min(k, n)
    sel = np.empty(k, np.int64)
    rtt = np.empty(k, np.float64)
    cost = np.empty(k, np.float64)
    m = 0
    for i in range(n):
        dot = _dot(d, i, px, py, pz)
        if m == k:
            chord = 2.0 - 2.0 * dot
            bound = d[i, key] + fixed + math.sqrt(chord if chord > 0.0 else 0.0) * scale
            if bound - _SLACK_S >= cost[k - 1]:
                continue
        r = _rtt(d, i, dot, scale, fixed, use_measured)
        c = d[i, key] + r
        if m == k and c >= cost[k - 1]:
            continue
        j = m if m < k else k - 1
        while j > 0 and cost[j - 1] > c:
            cost[j], sel[j], rtt[j] = cost[j - 1], sel[j - 1], rtt[j - 1]
            j -= 1
        cost[j], sel[j], rtt[j] = c, i, r
        if m < k:
            m += 1
    return sel, rtt


# Columns of price_candidates' answer, one row per candidate.
_COLUMNS = 12
SCORE, ROW, NET, ADMIT, LOCAL, COLO, PREFILL, LOCAL_QUEUE, LOCAL_SPT, ITL, POOLED, POOL_KV = range(
    _COLUMNS
)


@compiled
def price_candidates(
    d: FloatArray, key: int, pool: FloatArray, pool_rtt: FloatArray, px: float, py: float,
    pz: float, scale: float, fixed: float, use_measured: bool, k: int, extra: int,
    link_s: float, chunk: float, prompt: float, need: float, t: float,
) -> FloatArray:  # fmt: skip
    """The prefix-blind decision's numbers: the ``k`` cheapest decode rows (:func:`cheapest`)
    and row ``extra`` (-1: none) priced exactly, one answer row each, by score (ties in cut
    order). Per candidate: its cheapest prefill of its own (local, co-located peer) and over
    the pool (the member's RTT and the transfer not hidden behind its compute when the pages
    travel, its queue left at ``t``, ``prompt`` tokens at its rate), admission for ``need``
    KV tokens, and the score ``net + admission + SLO penalty + prefill`` (inf: it cannot
    prefill). ``pool`` [pool, PState] and ``pool_rtt`` [D, pool] (0: same PoP, no transfer)
    as ``LoadArrays`` keeps them; ``link_s`` the prompt's pages on an inter-PoP link."""
    sel, rtt = cheapest(d, key, px, py, pz, scale, fixed, use_measured, k)
    n = sel.shape[0]
    for j in range(n):
        if sel[j] == extra:
            extra = -1
    r = 0.0
    if extra >= 0:
        r = _rtt(d, extra, _dot(d, extra, px, py, pz), scale, fixed, use_measured)
        n += 1
    q = pool.shape[0]
    # Of each pool member: its queue left plus this prompt, and the transfer its pages leave
    # exposed (NetworkModel.kv_exposed_s: pages of all chunks but the last stream while later
    # chunks compute).
    ready = np.empty(q, np.float64)
    xfer = np.empty(q, np.float64)
    last_share = 1.0 if prompt <= chunk else chunk / prompt
    for b in range(q):
        wait = pool[b, _P_END] - t
        compute = prompt * pool[b, _P_SPT]
        ready[b] = (wait if wait > 0.0 else 0.0) + compute
        xfer[b] = max(link_s - compute, link_s * last_share)
    out = np.empty((n, _COLUMNS), np.float64)
    for j in range(n):
        if j < sel.shape[0]:
            i, r_j = sel[j], rtt[j]
        else:
            i, r_j = extra, r
        pooled, member, pool_kv = math.inf, -1, 0.0
        for b in range(q):
            hop = pool_rtt[i, b]
            kv = xfer[b] + hop if hop > 0.0 else 0.0
            v = kv + ready[b]
            if v < pooled:
                pooled, member, pool_kv = v, b, kv
        free, wait, l_end, l_inv = d[i, _FREE], d[i, _WAIT], d[i, _L_END], d[i, _L_SPT]
        l_max, c_end, c_inv, penalty = d[i, _L_MAX], d[i, _C_END], d[i, _C_SPT], d[i, _PENALTY]
        lq = l_end - t if l_end > t else 0.0
        local = lq + prompt * l_inv if prompt <= l_max else math.inf
        colo = (c_end - t if c_end > t else 0.0) + prompt * c_inv
        best = local if local <= colo else colo
        if pooled < best:
            best = pooled
        admit = 0.0 if free >= need else wait
        score = r_j + admit + penalty + best if best < math.inf else math.inf
        # Insertion by score (a handful of rows): after any equal score, so ties keep cut order.
        at = j
        while at > 0 and out[at - 1, SCORE] > score:
            for col in range(_COLUMNS):
                out[at, col] = out[at - 1, col]
            at -= 1
        out[at, SCORE], out[at, ROW], out[at, NET], out[at, ADMIT] = score, i, r_j, admit
        out[at, LOCAL], out[at, COLO], out[at, PREFILL] = local, colo, best
        out[at, LOCAL_QUEUE], out[at, LOCAL_SPT], out[at, ITL] = lq, l_inv, d[i, _ITL]
        out[at, POOLED], out[at, POOL_KV] = member, pool_kv
    return out


def unit_vector(lat_deg: float, lon_deg: float) -> tuple[float, float, float]:
    """The unit vector of a place, as :func:`~edgeinfer.router.network.unit_vectors` gives it,
    in plain floats (one place: numpy's fixed cost per call would be most of it)."""
    lat, lon = math.radians(lat_deg), math.radians(lon_deg)
    c = math.cos(lat)
    return (c * math.cos(lon), c * math.sin(lon), math.sin(lat))


class ClientRtt:
    """RTT floors from one client to the decode rows of one :class:`LoadArrays`: the cheapest
    rows in one compiled pass, any other row when asked (a prefix holder), each kept once known.
    ``use_measured``: the client is in the router's catchment, so the RTT the router measured
    to a daemon's PoP counts when it is larger than the floor."""

    def __init__(
        self, d_state: FloatArray, client: tuple[float, float, float], net: NetworkModel,
        use_measured: bool,
    ) -> None:  # fmt: skip
        """``d_state``: ``LoadArrays.d_state``; ``client``: the client's unit vector
        (:func:`unit_vector`)."""
        # Shrunk a hair, so that every dot product with a unit vector is inside [-1, 1]
        # (acos(1 - 1e-12) is 9 metres), as NetworkModel.rtt_floor_to_point_s does.
        s = 1.0 - 1e-12
        self.point = (client[0] * s, client[1] * s, client[2] * s)
        self.d, self.use_measured = d_state, use_measured
        self.scale, self.fixed = net.s_per_radian, net.fixed_rtt_s
        self.known: dict[int, float] = {}

    def cheapest(self, key: int, k: int) -> tuple[IntArray, list[float]]:
        """:func:`cheapest` for this client by ``d_state`` column ``key``: rows and their
        RTTs, cheapest first."""
        sel, rtt = cheapest(self.d, key, *self.point, self.scale, self.fixed, self.use_measured,
                            k)  # fmt: skip
        rtt_l = rtt.tolist()
        self.known.update(zip(sel.tolist(), rtt_l))
        return sel, rtt_l

    def __call__(self, i: int) -> float:
        """Row ``i``'s RTT (the same figure :func:`cheapest` gives for it)."""
        r = self.known.get(i)
        if r is None:
            r = self.known[i] = rtt_of(self.d, i, *self.point, self.scale, self.fixed,
                                       self.use_measured)  # fmt: skip
        return r


def warm() -> None:
    """Compile (or load from the disk cache) the passes before the first request needs them."""
    d = np.zeros((2, len(Row) + len(DState)))
    d[0, _X] = d[1, _Y] = 1.0
    cheapest(d, KEY_SHORT, 1.0, 0.0, 0.0, 1.0, 0.0, True, 1)  # the prefix path's cut
    rtt_of(d, 1, 1.0, 0.0, 0.0, 1.0, 0.0, True)  # and its holders
    price_candidates(d, KEY_SHORT, np.ones((1, len(PState))), np.zeros((2, 1)), 1.0,
                     0.0, 0.0, 1.0, 0.0, True, 1, 1, 0.0, 1.0, 1.0, 1.0, 0.0)  # fmt: skip
