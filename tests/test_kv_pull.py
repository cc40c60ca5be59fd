"""kv_pull: the prefill daemon receives the leading pages its decode daemon holds (issue 17).

A second chat turn: the decode daemon holds the first turn's prompt *and* answer, the prefill
daemon only the prompt. With a pull the prefill side receives the answer's blocks instead of
recomputing them; the tokens are the same as one engine's, the prefill side's ``num_computed``
leaves the pulled blocks out, and every block is released. Whether to pull is priced
(:mod:`edgeinfer.daemon.kv_transfer.pull_price`); the tests pin the prefill rate to decide.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from edgeinfer.daemon.config import DaemonConfig
from edgeinfer.daemon.engine.outputs import RequestOutput
from edgeinfer.daemon.engine.sampling_params import SamplingParams
from edgeinfer.daemon.kv_transfer.decode_client import ClientCurve
from edgeinfer.daemon.kv_transfer.messages import FEATURE_KV_PULL, Pong, PrefillRequest
from edgeinfer.daemon.kv_transfer.prefill_server import ServerCurve
from edgeinfer.daemon.kv_transfer.pull_price import (
    DEFAULT_PRICES,
    PullPrices,
    measured_prices,
    pull_saves_time,
)
from edgeinfer.daemon.kv_transfer.security import generate_keys
from edgeinfer.daemon.kv_transfer.stats import TransferStats
from edgeinfer.daemon.kv_transfer.wire import decode, encode
from edgeinfer.daemon.load_report import LoadTracker
from edgeinfer.daemon.metrics import DaemonMetrics
from edgeinfer.daemon.transfer_plane import TransferPlane
from kv_transfer_helpers import (
    BLOCK_SIZE,
    LAYOUT,
    Pair,
    build_checkpoint,
    prompt_of,
    reference_tokens,
    running_pair,
    start_engine,
)

PATIENCE_S = 60.0  # a hang guard: every wait ends at its event long before this
ANSWER = SamplingParams.greedy_params(max_tokens=40, ignore_eos=True)
SLOW_PREFILL = 1.0  # tokens/s: pulling always wins
FAST_PREFILL = 1e15  # recomputing always wins


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("kv_pull"))


async def until(condition: Callable[[], bool], what: str) -> None:
    async with asyncio.timeout(PATIENCE_S):
        while not condition():
            await asyncio.sleep(0.005)
    assert condition(), what


async def generate(pair: Pair, rid: str, prompt: Sequence[int]) -> tuple[RequestOutput, list[int]]:
    stream = pair.decode.open_stream(rid)
    try:
        first = await pair.client.prefill(rid, prompt, ANSWER, pair.endpoint)
        tokens = list(first.new_token_ids)
        if not first.finished:
            async for out in pair.decode.iterate(stream):
                tokens.extend(out.new_token_ids)
        return first, tokens
    finally:
        pair.decode.close_stream(rid)


def curve_keys(root: Path) -> tuple[ServerCurve, ClientCurve]:
    server_public, server_secret = generate_keys(root / "server", "prefill")
    client_public, client_secret = generate_keys(root / "client", "decode")
    allowed = root / "allowed"
    allowed.mkdir()
    (allowed / "decode.key").write_bytes(client_public.read_bytes())
    return ServerCurve(server_secret, allowed), ClientCurve(client_secret, server_public)


@pytest.mark.asyncio
@pytest.mark.parametrize(("pull", "curve"), [(True, False), (False, False), (True, True)])
async def test_second_turn_pulls_the_answer_blocks(
    checkpoint: Path, tmp_path: Path, pull: bool, curve: bool
) -> None:
    first_prompt = prompt_of(40, offset=11)
    server_curve, client_curve = curve_keys(tmp_path) if curve else (None, None)
    async with running_pair(
        checkpoint,
        server_curve=server_curve,
        client_curve=client_curve,
        prefill_rate=lambda: SLOW_PREFILL if pull else FAST_PREFILL,
    ) as pair:
        _, answer = await generate(pair, "turn-1", first_prompt)
        # The decode side offers pages only once the prefill daemon said it takes them.
        await until(lambda: pair.client.peer_features(pair.endpoint) is not None, "the pong")
        assert pair.client.peer_features(pair.endpoint) == {FEATURE_KV_PULL}
        second_prompt = first_prompt + answer + prompt_of(24, offset=99)
        # Decode holds 4 blocks (40 prompt + 39 computed answer tokens), prefill 2 (the prompt).
        held = await pair.decode.call(lambda e: e.cached_prefix_tokens(second_prompt))
        own = await pair.prefill.call(lambda e: e.cached_prefix_tokens(second_prompt))
        assert (held, own) == (4 * BLOCK_SIZE, 2 * BLOCK_SIZE)
        computed_before = pair.prefill.engine.prompt_tokens_computed
        first, tokens = await generate(pair, "turn-2", second_prompt)
        computed = pair.prefill.engine.prompt_tokens_computed - computed_before

        want = reference_tokens(checkpoint, [first_prompt, second_prompt], ANSWER)
        assert [answer, tokens] == want
        pulled = 2 if pull else 0
        assert pair.server.stats.pulled_blocks == pulled
        assert pair.client.stats.pulled_blocks == pulled  # the decode side served them
        # What the prefill side computed leaves the pulled blocks out; the decode side counts
        # them as cached (usage.cached_tokens).
        assert computed == len(second_prompt) - (2 + pulled) * BLOCK_SIZE
        assert first.num_cached_tokens == (2 + pulled) * BLOCK_SIZE
        # Without CURVE the peer is not authenticated: its pages, and the blocks computed on
        # top of them, never join the prefill daemon's prefix cache; with it they do.
        after = await pair.prefill.call(lambda e: e.cached_prefix_tokens(second_prompt))
        every_full_block = len(second_prompt) // BLOCK_SIZE * BLOCK_SIZE
        assert after == (2 * BLOCK_SIZE if pull and not curve else every_full_block)
        await until(
            lambda: pair.prefill_blocks_used() == 0 and pair.decode_blocks_used() == 0,
            "every block released",
        )
        assert pair.server.stats.pull_fallbacks == {}


def test_pull_rule() -> None:
    prices = PullPrices(prefill_tokens_per_s=1000.0, link_bytes_per_s=1e6, rtt_s=0.01)
    # 100 tokens of 1 kB: 10 ms + 100 ms on the wire against 100 ms of compute.
    assert not pull_saves_time(100, 1000, prices)
    assert pull_saves_time(100, 100, prices)  # 10 ms + 10 ms
    assert not pull_saves_time(0, 1, prices)
    assert measured_prices(0.0, None, None) == DEFAULT_PRICES  # unmeasured: the defaults
    assert measured_prices(5.0, 7.0, 0.0) == PullPrices(5.0, 7.0, 0.0)


def test_extensions_stay_off_the_wire_unless_used() -> None:
    """An older peer rejects unknown header keys: a request that offers nothing and a pong
    listing nothing must look exactly as version 1 always did."""
    plain = PrefillRequest("r", 0, (1, 2), {}, (0,), LAYOUT)
    assert b"offers_pages" not in bytes(encode(plain)[0])
    assert b"features" not in bytes(encode(Pong("", 3))[0])
    offering = PrefillRequest("r", 0, (1, 2), {}, (0,), LAYOUT, offers_pages=True)
    assert decode(encode(offering)) == offering
    pong = Pong("", 3, (FEATURE_KV_PULL,))
    assert decode(encode(pong)) == pong


def test_pulled_blocks_metric() -> None:
    """The prefill side's pulled blocks count as received, the decode side's as sent."""
    metrics = DaemonMetrics()
    server, client = TransferStats(), TransferStats()
    server.record_pull(3, 3000, 0.001, 0.002)
    client.pulled_blocks = 3

    def pulled(direction: str) -> float:
        metrics.sync_transfer_stats(server, "sent")
        metrics.sync_transfer_stats(client, "received")
        want = f'edgeinfer_kv_pulled_blocks_total{{direction="{direction}"}} '
        for line in metrics.render().decode().splitlines():
            if line.startswith(want):
                return float(line.split()[-1])
        raise AssertionError(f"no {want}")

    assert (pulled("received"), pulled("sent")) == (3, 3)
    assert server.pull_rtt_s == 0.001 and server.pull_link_bytes_per_s == 1.5e6


@pytest.mark.asyncio
async def test_decode_daemon_learns_its_configured_peers_features_at_start(
    checkpoint: Path,
) -> None:
    """A decode daemon connects to its configured prefill peers when it starts, so their pongs
    (and with them ``kv_pull``) are in before its first request, which can then offer pages."""
    async with running_pair(checkpoint) as pair:
        engine = await start_engine(checkpoint)
        config = DaemonConfig(
            model=str(checkpoint), role="decode", host="127.0.0.1", port=0, kv_port=0,
            heartbeat_port=0, prefill_peers=(pair.endpoint,), enable_prefix_caching=False,
        )  # fmt: skip
        metrics = DaemonMetrics()
        load = LoadTracker(config, engine, metrics, lambda: (False, False, 0))
        plane = TransferPlane(config, engine, load, metrics)
        try:
            await plane.start()
            client = plane.client
            assert client is not None
            await until(lambda: client.peer_features(pair.endpoint) is not None, "no pong")
            assert FEATURE_KV_PULL in (client.peer_features(pair.endpoint) or ())
        finally:
            await plane.stop(drain=False)
            await engine.stop()
