"""Remote prefill end to end over ZeroMQ: token parity, prefix reuse, concurrency, CURVE."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from edgeinfer.daemon.kv_transfer.decode_client import (
    ClientCurve,
    PrefillFailed,
    RemotePrefillClient,
)
from edgeinfer.daemon.kv_transfer.prefill_server import ServerCurve
from edgeinfer.daemon.kv_transfer.security import generate_keys
from kv_transfer_helpers import (
    GREEDY,
    build_checkpoint,
    kv_bytes,
    prompt_of,
    reference_tokens,
    remote_generate,
    running_pair,
)

pytestmark = pytest.mark.asyncio

LENGTHS = (1, 15, 16, 17, 200)  # single token, partial block, exact block, block + 1, chunked


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("kv_e2e"))


def distinct_prompt(length: int) -> list[int]:
    # Different first tokens: no prompt shares a prefix-cache block with another.
    return prompt_of(length, offset=31 * length)


async def test_remote_prefill_matches_single_engine(checkpoint: Path) -> None:
    prompts = [distinct_prompt(n) for n in LENGTHS]
    want = reference_tokens(checkpoint, prompts)
    async with running_pair(checkpoint) as pair:
        for n, prompt, expected in zip(LENGTHS, prompts, want):
            got = await remote_generate(pair, f"parity-{n}", prompt)
            assert got == expected, f"{n}-token prompt"
        assert pair.server.stats.transfers_ok == len(LENGTHS)
        assert pair.client.stats.transfers_ok == len(LENGTHS)
        # Every prompt block of every layer crossed the wire exactly once.
        total_blocks = sum(-(-n // 16) for n in LENGTHS)
        assert pair.client.stats.kv_bytes_received == kv_bytes(total_blocks)
        assert pair.server.stats.kv_bytes_sent == kv_bytes(total_blocks)
        assert not pair.client.stats.dropped and not pair.server.stats.dropped
        assert pair.prefill_blocks_used() == 0 and pair.decode_blocks_used() == 0
        assert pair.server.in_flight == 0


async def test_decode_prefix_cache_skips_held_blocks(checkpoint: Path) -> None:
    base = prompt_of(200, offset=1000)
    shared = base[:160] + prompt_of(40, offset=2000)  # 10 whole blocks in common
    whole = base[:192]  # every block already held: only the first token crosses the wire
    want = reference_tokens(checkpoint, [base, shared, whole])
    async with running_pair(checkpoint) as pair:
        assert await remote_generate(pair, "prefix-1", base) == want[0]
        assert pair.server.stats.kv_bytes_sent == kv_bytes(13)
        assert await remote_generate(pair, "prefix-2", shared) == want[1]
        # Blocks 10..12 only: the decode engine already held blocks 0..9.
        assert pair.server.stats.kv_bytes_sent == kv_bytes(13 + 3)
        assert pair.client.stats.kv_bytes_received == kv_bytes(13 + 3)
        assert pair.decode.engine.stats().prefix_cache_hits == 10
        assert await remote_generate(pair, "prefix-3", whole) == want[2]
        assert pair.server.stats.kv_bytes_sent == kv_bytes(13 + 3)
        assert pair.client.stats.transfers_ok == 3


async def test_concurrent_transfers_share_one_connection(checkpoint: Path) -> None:
    prompts = [prompt_of(40 + 30 * i, offset=300 + i) for i in range(6)]
    async with running_pair(checkpoint) as pair:
        results = await asyncio.gather(
            *(remote_generate(pair, f"conc-{i}", p) for i, p in enumerate(prompts))
        )
        assert [len(r) for r in results] == [6] * len(prompts)
        assert pair.client.stats.transfers_ok == len(prompts)
        assert len(pair.client._peers) == 1  # one DEALER per endpoint, reused
        assert pair.prefill_blocks_used() == 0 and pair.decode_blocks_used() == 0


async def test_curve_encrypted_transfer(checkpoint: Path, tmp_path: Path) -> None:
    server_public, server_secret = generate_keys(tmp_path / "server", "prefill")
    client_public, client_secret = generate_keys(tmp_path / "client", "decode")
    _, stranger_secret = generate_keys(tmp_path / "stranger", "decode")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "decode.key").write_bytes(client_public.read_bytes())
    prompt = distinct_prompt(17)
    want = reference_tokens(checkpoint, [prompt])[0]
    async with running_pair(
        checkpoint,
        server_curve=ServerCurve(server_secret, allowed),
        client_curve=ClientCurve(client_secret, server_public),
    ) as pair:
        assert await remote_generate(pair, "curve-ok", prompt) == want
        # A client whose key is not allowed is refused at the handshake, not left hanging: the
        # reason says so, long before this timeout (a hang guard) could end the wait.
        stranger = RemotePrefillClient(
            pair.decode, curve=ClientCurve(stranger_secret, server_public), timeout_s=60.0
        )
        try:
            with pytest.raises(PrefillFailed) as failure:
                await stranger.prefill("curve-stranger", prompt, GREEDY, pair.endpoint)
        finally:
            await stranger.close()
        assert failure.value.reason == "handshake_failed"
        assert pair.decode_blocks_used() == 0
        assert pair.server.stats.transfers_started == 1
