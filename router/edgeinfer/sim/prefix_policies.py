"""Placement policies that know where prefixes are cached, for prefix-sharing traces.

* ``max-prefix``: the decode and the prefill daemon holding the most leading blocks of the
  prompt, ties by load. What published cache-aware schedulers start from, and what their users
  complain about: one hot prefix sends everything to one daemon.
* ``session-hash``: a consistent (rendezvous) hash of the session, here the prompt's first
  block, picks the decode daemon, and the prefill daemon among those of its PoP: affinity
  without any knowledge of caches or load (Cloudflare's ``x-session-affinity``).
* ``prefix-aware``: the router's expected TTFT with the prefix terms of
  :mod:`edgeinfer.router.prefix_scoring` (uncached suffix on the prefill daemon, only the
  blocks the decode daemon lacks on the transfer) over the selector's own load arrays
  (:mod:`edgeinfer.router.load_arrays`: same snapshot, same ledger, same admission and ITL
  terms), with the bounded-load guard on decode daemons (sequences) and prefill daemons (queue
  seconds), and the selector's near-tie spreading. A prefill daemon lacking blocks its decode
  daemon holds receives them where that is cheaper (:mod:`edgeinfer.router.kv_pull`, as the
  daemons and the simulator do), so the pair is priced with the pull: a prefill daemon beside
  the decode daemon holding a conversation is as good as one holding it itself.

``router-prefix-blind`` is the selector as it is (``policies.SelectorPolicy``). Every policy
here records what it sends in the registry's ledger, as the others do.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence

import numpy as np

from edgeinfer.router.inflight import PlacementLedger
from edgeinfer.router.load_columns import Row
from edgeinfer.router.network import NetworkModel
from edgeinfer.router.placement import PlacementConfig
from edgeinfer.router.pop_registry import DaemonView
from edgeinfer.router.prefix_scoring import (
    cached_tokens,
    price_pairs_pulling,
    rank,
    under_bound,
)
from edgeinfer.router.prepared import prepared
from edgeinfer.router.selector import RequestFeatures
from edgeinfer.sim.policies import Choice, HitsFn, _Baseline
from edgeinfer.sim.prefix_cache import BLOCK_TOKENS

LOAD_EPS = PlacementConfig.load_eps  # bounded load: no daemon above 1.25x the mean
WORK_WEIGHT = PlacementConfig.work_weight  # see prefix_scoring.price_pairs
_M64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit hash of an int, the same in every process."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _url_hash(url: str) -> int:
    return int.from_bytes(hashlib.blake2b(url.encode(), digest_size=8).digest(), "little")


class MaxPrefixPolicy(_Baseline):
    def _most(self, hits: np.ndarray, loads: np.ndarray) -> int:
        return self._least(loads, np.flatnonzero(hits == hits.max()).tolist())

    def place(
        self, views: Sequence[DaemonView], pending: PlacementLedger, lat: float, lon: float,
        f: RequestFeatures, here: str, now: float, keys: Sequence[int] = (),
    ) -> list[Choice]:  # fmt: skip
        self._refresh(views, pending)
        if not self.d:
            return []
        hits = self.hits(keys) if self.hits is not None and keys else {}
        d_hits = np.array([hits.get(v.url, 0) for v in self.d])
        di = self._most(d_hits, self.d_load)
        d = self.d[di]
        suffix = f.prompt_tokens - cached_tokens(f.prompt_tokens, int(d_hits[di]), BLOCK_TOKENS)
        if d.role == "both" or suffix <= d.local_prefill_threshold or not self.p:
            return self._take(di, None, f, lat, lon)
        p_hits = np.array([hits.get(v.url, 0) for v in self.p])
        return self._take(di, self._most(p_hits, self.p_load), f, lat, lon)


class SessionHashPolicy(_Baseline):
    def __init__(self, name: str, net: NetworkModel, cfg: PlacementConfig, seed: int) -> None:
        super().__init__(name, net, cfg, seed)
        self._url_h: dict[str, int] = {}

    def _pick(self, session: int, among: Sequence[DaemonView]) -> int:
        """Rendezvous hashing: the daemon with the highest hash of (session, daemon); a daemon
        leaving moves only its own sessions."""
        h = self._url_h
        scores = [_mix(session ^ h.setdefault(v.url, _url_hash(v.url))) for v in among]
        return scores.index(max(scores))

    def place(
        self, views: Sequence[DaemonView], pending: PlacementLedger, lat: float, lon: float,
        f: RequestFeatures, here: str, now: float, keys: Sequence[int] = (),
    ) -> list[Choice]:  # fmt: skip
        self._refresh(views, pending)
        if not self.d:
            return []
        session = _mix(keys[0]) if keys else self.rng.getrandbits(64)
        di = self._pick(session, self.d)
        peers = self.pop_p.get(self.d[di].pop, [])
        if self._local(self.d[di], f) or not peers:
            return self._take(di, None, f, lat, lon)
        return self._take(di, peers[self._pick(session, [self.p[i] for i in peers])], f, lat, lon)


class PrefixAwarePolicy:
    def __init__(
        self, name: str, net: NetworkModel, cfg: PlacementConfig, seed: int,
        eps: float | None = None,
    ) -> None:  # fmt: skip
        self.name, self.net, self.cfg = name, net, cfg
        self.eps = LOAD_EPS if eps is None else eps
        self.rng = random.Random(seed)
        self.hits: HitsFn | None = None
        # Per answer: D, P (None: local), decode lag, prefill lag, tokens to prefill, its s.
        self._answers: list[tuple[DaemonView, DaemonView | None, float, float, int, float]] = []
        self._rtt: tuple[object, np.ndarray] | None = None
        self._kv_tokens = 0

    def attach(self, hits: HitsFn) -> None:
        self.hits = hits

    def place(
        self, views: Sequence[DaemonView], pending: PlacementLedger, lat: float, lon: float,
        f: RequestFeatures, here: str, now: float, keys: Sequence[int] = (),
    ) -> list[Choice]:  # fmt: skip
        cfg = self.cfg
        prep = prepared(views, self.net, cfg, pending)
        model = f.model if f.model is not None else prep.default_model
        a = prep.arrays(model, now) if model is not None else None
        self._answers = []
        if a is None or not a.d:
            return []
        prompt = max(1, f.prompt_tokens)
        hits = self.hits(keys) if self.hits is not None and keys else {}
        d_cached = np.array([cached_tokens(prompt, hits.get(v.url, 0), BLOCK_TOKENS) for v in a.d],
                            dtype=np.int64)  # fmt: skip
        p_cached = np.array([cached_tokens(prompt, hits.get(v.url, 0), BLOCK_TOKENS) for v in a.p],
                            dtype=np.int64)  # fmt: skip
        rows = a.row_arr
        free, wait, l_end, l_inv, local_max, pen = (rows[:, k] for k in (
            Row.FREE_TOKENS, Row.ADMIT_WAIT_S, Row.LOCAL_END, Row.LOCAL_S_PER_TOKEN,
            Row.LOCAL_MAX_TOKENS, Row.PENALTY,
        ))  # fmt: skip
        admit = np.where(free >= prompt + f.max_tokens, 0.0, wait)
        lat_r, lon_r = math.radians(lat), math.radians(lon)
        xyz = (math.cos(lat_r) * math.cos(lon_r), math.cos(lat_r) * math.sin(lon_r),
               math.sin(lat_r))  # fmt: skip
        net_s = self.net.rtt_floor_to_point_s(a.d_xyz, xyz)
        if self._rtt is None or self._rtt[0] is not a:
            self._rtt = (a, a.geo.rtt[np.ix_(a.d_pop, a.p_pop)])
        p_queue = np.maximum(a.p_end - now, 0.0)
        job_s = prompt * float(a.p_inv.mean()) if len(a.p) else 0.0
        prices = price_pairs_pulling(
            self.net, prompt, a.kv_bytes_per_token, cfg.prefill_chunk_tokens,
            net_s + admit + pen, d_cached, np.maximum(l_end - now, 0.0), l_inv,
            prompt - d_cached <= local_max,
            p_cached, p_queue, a.p_inv, under_bound(p_queue, job_s, self.eps), self._rtt[1],
            a.d_pop, WORK_WEIGHT,
        )  # fmt: skip
        load = a.load.copy()
        # Among near-ties, the router prefers what reuses the most (prefix_pairs.rank_found):
        # the prefill not computed, and the pages D need not receive.
        saved = prompt - prices.computed_tokens + d_cached
        order = rank(prices.score_s, load, under_bound(load, 1.0, self.eps), cfg.near_tie_s,
                     self.rng, cached=saved,
                     recent=lambda i: pending.recent(a.d[i].url, now))  # fmt: skip
        self._kv_tokens = prompt + f.max_tokens
        out: list[Choice] = []
        for i in order:
            d, pi = a.d[i], int(prices.prefill[i])
            p = a.p[pi] if pi >= 0 and a.p[pi].url != d.url else None
            to_d = float(net_s[i])
            self._answers.append((d, p, to_d, to_d + float(admit[i] + prices.kv_s[i]),
                                  int(prices.computed_tokens[i]), float(prices.compute_s[i])))  # fmt: skip
            out.append((d.url, p.url if p is not None else None))
        return out

    def placed(self, k: int, f: RequestFeatures, pending: PlacementLedger, now: float) -> None:
        d, p, to_d, to_p, tokens, compute_s = self._answers[k]
        pending.record(now, d.url, p.url if p is not None else None, tokens, self._kv_tokens,
                       to_d, to_p, compute_s)  # fmt: skip


PREFIX_POLICIES = {
    "max-prefix": MaxPrefixPolicy,
    "session-hash": SessionHashPolicy,
    "prefix-aware": PrefixAwarePolicy,
}
