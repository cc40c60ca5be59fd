"""Small worlds for the simulator's tests: a few PoPs, seconds of traffic, a fixed profile.

The profile is inline (not the measured JSON) so a re-measurement cannot move test numbers.
"""

from __future__ import annotations

import numpy as np

from edgeinfer.sim.metrics import Slo
from edgeinfer.sim.profile import EngineProfile
from edgeinfer.sim.simulator import SimConfig
from edgeinfer.sim.topology import SimPop, Split, Topology, build_topology
from edgeinfer.sim.workload import Workload

PROFILE = EngineProfile(
    prefill_fixed_s=0.004, prefill_token_s=4e-5, prefill_attention_s=1e-9,
    decode_fixed_s=0.007, decode_seq_s=1e-4, decode_context_token_s=5e-8,
    kv_bytes_per_token=131_072, max_num_batched_tokens=2048,
)  # fmt: skip
SLO = Slo(ttft_s=1.0, itl_s=0.05)


def small_world(pops: int = 9) -> Topology:
    return build_topology(pops, Split(1, 2), ("na", "eu", "as"), seed=0)


def one_pop(split: Split) -> Topology:
    return Topology((SimPop("solo", "eu", "london", 51.5, -0.1, split),))


def poisson_at(
    lat: float, lon: float, rate: float, n: int, prompt_mean: float, output: int, seed: int
) -> Workload:
    """``n`` Poisson arrivals from one spot, geometric prompts of mean ``prompt_mean``."""
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / rate, n))
    prompt = rng.geometric(1 / prompt_mean, n).astype(np.int64)
    out = np.full(n, output, dtype=np.int64)
    lats, lons = np.full(n, lat), np.full(n, lon)
    return Workload(t, prompt, out, lats, lons, ["eu"] * n, "poisson", float(t[-1]))


def quiet_config(**kw: object) -> SimConfig:
    """No jitter, so network time is a known constant."""
    return SimConfig(jitter_sigma=0.0, **kw)  # type: ignore[arg-type]
