"""``prefix_aware_placement``: on by default; off, the router places without prefix knowledge
(no tokenizer fetched, no prompt tokenised), which is what ``bench/prefix_routing.py`` compares."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgeinfer.router.config import RouterConfig, load_router_config
from edgeinfer.router.proxy import PROXY_KEY
from router_helpers import start_cluster


def test_the_knob_is_on_by_default_and_set_by_env(tmp_path: Path) -> None:
    assert RouterConfig().prefix_aware_placement
    env = {"EDGEINFER_PREFIX_AWARE_PLACEMENT": "false"}
    assert not load_router_config(None, env=env).prefix_aware_placement


@pytest.mark.asyncio
@pytest.mark.parametrize("aware", [True, False])
async def test_a_prefix_blind_router_still_places(tmp_path: Path, aware: bool) -> None:
    extra = {"prefix_aware_placement": "true" if aware else "false"}
    async with start_cluster(tmp_path, extra=extra) as cluster:
        assert (cluster.app[PROXY_KEY].prefix is not None) == aware
        resp = await cluster.post()
        assert resp.status == 200, await resp.text()
