"""``selector.warm()`` compiles every compiled pass a decision runs, for the argument types the
router passes: no request waits for the compiler. (A pass compiled inside a request takes
seconds; a cold router's first prefix request once did, its daemons' heartbeats went stale
meanwhile, and the request was refused for want of a placement.)

In a fresh interpreter, as a router process starts: warm, then decisions on every path, then
no compiled function may have gained a signature."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import random
from edgeinfer.router import candidate_cut, load_update, prefix_pairs, prefix_select, selector
from edgeinfer.router.placement import PrefixHits, RequestFeatures
from edgeinfer.router.session_affinity import affinity_key
from test_router_selector import CFG, LONDON, NET, World

def signatures():
    return {f"{m.__name__}.{n}": list(f.signatures)
            for m in (candidate_cut, load_update, prefix_pairs, prefix_select)
            for n, f in vars(m).items() if hasattr(f, "signatures") and hasattr(f, "py_func")}

selector.warm()
warmed = signatures()
w = World({"lon": ("http://lon-d:8000", "http://lon-p:8000"), "sea": ("http://sea-b:8000",),
           "cgq": ("http://cgq-b:8000",)})
for url, role in (("http://lon-d:8000", "decode"), ("http://lon-p:8000", "prefill"),
                  ("http://sea-b:8000", "both"), ("http://cgq-b:8000", "both")):
    w.beat(url, role=role)
rng, pending = random.Random(1), w.reg.pending
held = {"http://lon-d:8000": 10, "http://lon-p:8000": 30, "http://sea-b:8000": 50}
features = [
    RequestFeatures(100, 16, "m"), RequestFeatures(9000, 16, None),
    RequestFeatures(100, 16, "m", affinity=affinity_key("t", "s")),
    RequestFeatures(900, 16, "m", PrefixHits(900, 56, 16, held)),
    RequestFeatures(900, 16, "m", PrefixHits(900, 56, 16, {}, lambda urls: held)),
]
for step in range(3):
    for f in features:
        placed = selector.select(w.reg.snapshot(w.now), LONDON, f, NET, CFG, rng, "lon",
                                 pending=pending, now=w.now)
        ticket = selector.record_placement(pending, placed[0], f, w.now)
        if step == 1:
            pending.cancel(ticket)
    w.now += 0.5
    w.beat("http://sea-b:8000", role="both", running=step)
grown = {n: s for n, s in signatures().items() if s != warmed[n]}
assert not grown, f"compiled during decisions: {grown}"
print("ok", len(warmed))
"""


def test_warm_compiles_what_decisions_run() -> None:
    tests = Path(__file__).parent
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=tests, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok")
