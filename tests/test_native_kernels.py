"""The compiled C++ attention kernels (decode and prefill): parity with a float64 oracle, their
guards, the build cache, every kernel built for x86-64-v2, x86-64-v3 and this CPU, and the
engine's fallback to the portable kernels when they are off."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from edgeinfer.daemon.engine import cpu_attention
from edgeinfer.daemon.engine.config import EngineConfig
from edgeinfer.daemon.engine.llm_engine import LLMEngine
from edgeinfer.daemon.engine.rope import Rotation
from edgeinfer.daemon.engine.sampling_params import SamplingParams
from edgeinfer.daemon.engine.tiny_checkpoint import build_tiny_checkpoint
from edgeinfer.kernels import decoder_pointwise, native_build, skinny_gemm
from edgeinfer.kernels import paged_attention_native as native
from engine_helpers import assert_matches, hf_greedy, random_prompts
from native_helpers import require_native
from test_paged_attention import LENGTHS, check, make_cache, naive_attention, naive_decode

KERNELS = (
    "paged_decode_attention", "paged_prefill_attention", "decoder_pointwise", "skinny_gemm",
    "decode_layers",
)  # fmt: skip


@pytest.fixture
def native_attention() -> None:
    require_native("paged_decode_attention", "paged_prefill_attention")


# Skips without a compiler (the numba kernel serves); a failed build fails.
needs_compiler = pytest.mark.usefixtures("native_attention")


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [32, 64, 128])  # generic loop, then both specialised ones
@pytest.mark.parametrize("page", [16, 8])
def test_native_decode_matches_naive(dtype, group, head_dim, page):
    k_cache, v_cache, tables, lens = make_cache(LENGTHS, 2, head_dim, page, dtype)
    lens[2] = 0  # a row without context gives zeros
    scale = head_dim**-0.5
    q = torch.randn(len(LENGTHS), 2 * group, head_dim).to(dtype)
    out = native.paged_decode_attention_native(q, k_cache, v_cache, tables, lens, scale)
    check(out, naive_decode(q, k_cache, v_cache, tables, lens, scale), dtype)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    # Into a caller's buffer, from a strided view of q (the engine's q is a slice of q|k|v).
    qkv = torch.randn(len(LENGTHS), 2 * group + 4, head_dim).to(dtype)
    dest = torch.full_like(q, float("nan"))
    native.paged_decode_attention_native(
        qkv[:, : 2 * group], k_cache, v_cache, tables, lens, scale, dest
    )
    check(dest, naive_decode(qkv[:, : 2 * group], k_cache, v_cache, tables, lens, scale), dtype)


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_native_decode_merges_split_contexts(threads, monkeypatch):
    # Long contexts at batch 1-3 are cut into ranges that threads attend separately and that
    # are merged afterwards; a small minimum split forces many ranges, some a partial page.
    monkeypatch.setattr(native, "MIN_SPLIT_KEYS", 16)
    lengths = [1000, 7, 333]
    k_cache, v_cache, tables, lens = make_cache(lengths, 3, 64, 16, torch.float32)
    q = torch.randn(len(lengths), 9, 64)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = native.paged_decode_attention_native(q, k_cache, v_cache, tables, lens, 0.125)
    finally:
        torch.set_num_threads(before)
    check(out, naive_decode(q, k_cache, v_cache, tables, lens, 0.125), torch.float32)


@needs_compiler
def test_native_decode_reads_bf16_pages_exactly():
    # bf16 widens to float32 exactly: the same pages in float32 give the float32 result that
    # the kernel rounds once to bf16.
    k_cache, v_cache, tables, lens = make_cache(LENGTHS, 2, 64, 16, torch.bfloat16)
    q = torch.randn(len(LENGTHS), 6, 64).to(torch.bfloat16)
    out = native.paged_decode_attention_native(q, k_cache, v_cache, tables, lens, 0.125)
    wide = native.paged_decode_attention_native(
        q.float(), k_cache.float(), v_cache.float(), tables, lens, 0.125
    )
    torch.testing.assert_close(out, wide.to(torch.bfloat16), atol=0, rtol=2**-8)


@needs_compiler
def test_native_decode_rejects_what_it_cannot_take():
    k_cache, v_cache, tables, lens = make_cache([5, 20], 2, 16, 16, torch.float16)
    q = torch.randn(2, 4, 16, dtype=torch.float16)
    assert not native.supports(q, k_cache)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        native.paged_decode_attention_native(q, k_cache, v_cache, tables, lens, 0.25)
    k_cache, v_cache = k_cache.float(), v_cache.float()
    q = torch.randn(2, 4, 16)
    with pytest.raises(ValueError, match="float32 or bfloat16"):  # 3 heads over 2 KV heads
        native.paged_decode_attention_native(q[:, :3], k_cache, v_cache, tables, lens, 0.25)
    with pytest.raises(ValueError, match="block table"):
        native.paged_decode_attention_native(
            q, k_cache, v_cache, tables[:, :1], torch.tensor([5, 20]), 0.25
        )
    bad = tables.clone()
    bad[0, 0] = k_cache.shape[0]  # one past the last block: the kernel would read past the cache
    with pytest.raises(ValueError, match="outside the cache"):
        native.paged_decode_attention_native(q, k_cache, v_cache, bad, lens, 0.25)
    with pytest.raises(ValueError, match="out must be"):
        native.paged_decode_attention_native(
            q, k_cache, v_cache, tables, lens, 0.25, torch.empty(2, 4, 32)[..., :16]
        )


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepared_decode_serves_every_layer_of_a_step(dtype):
    # One step's tables checked once, then run over each layer's own caches and queries.
    layers = [make_cache(LENGTHS, 2, 64, 16, dtype, seed=i) for i in range(3)]
    tables, lens = layers[0][2], layers[0][3]
    for _, _, t, n in layers[1:]:
        t.copy_(tables)
        n.copy_(lens)
    prepared = native.PreparedDecode(tables, lens, layers[0][0].shape, dtype, heads=6)
    for k_cache, v_cache, _, _ in layers:
        q = torch.randn(len(LENGTHS), 6, 64).to(dtype)
        out = torch.empty_like(q)
        assert prepared(q, k_cache, v_cache, 0.125, out) is out
        expected = native.paged_decode_attention_native(q, k_cache, v_cache, tables, lens, 0.125)
        assert torch.equal(out, expected)
    k_cache, v_cache = layers[0][0], layers[0][1]
    with pytest.raises(ValueError, match="does not fit the prepared step"):
        prepared(torch.randn(len(LENGTHS), 4, 64).to(dtype), k_cache, v_cache, 0.125)
    with pytest.raises(ValueError, match="does not fit the prepared step"):
        prepared(q, k_cache[:-1], v_cache[:-1], 0.125)
    bad = tables.clone()
    bad[0, 0] = k_cache.shape[0]
    with pytest.raises(ValueError, match="outside the cache"):
        native.PreparedDecode(bad, lens, k_cache.shape, dtype, heads=6)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize(
    ("start", "chunk", "group"),
    [(0, 1, 1), (0, 37, 3), (0, 200, 2), (5, 37, 3), (16, 64, 4), (130, 100, 3), (300, 3, 1)],
)
def test_native_prefill_matches_naive(dtype, head_dim, start, chunk, group):
    # Fresh prompts and later chunks (prefixes inside a page and on its edge), query blocks of
    # 32 tokens cut mid-way, 64-key tiles cut mid-way, and a strided q (a slice of q|k|v).
    # bfloat16 at head sizes 64 and 128 takes the dot-product path where the CPU has
    # AVX512-BF16 (odd key counts included), 32 and float32 the float32 one.
    k_cache, v_cache, tables, _ = make_cache([start + chunk], 2, head_dim, 16, dtype)
    qkv = torch.randn(chunk, 2 * group + 4, head_dim).to(dtype)
    q = qkv[:, : 2 * group]
    scale = head_dim**-0.5
    out = native.paged_prefill_attention_native(q, k_cache, v_cache, tables[0], start, scale)
    qpos = torch.arange(start, start + chunk)
    check(out, naive_attention(q, k_cache, v_cache, tables[0], start + chunk, qpos, scale), dtype)


@needs_compiler
def test_native_prefill_writes_into_out_and_checks_its_table():
    k_cache, v_cache, tables, _ = make_cache([40], 2, 32, 16, torch.float32)
    q = torch.randn(8, 4, 32)
    dest = torch.full((8, 4, 32), float("nan"))
    assert (
        native.paged_prefill_attention_native(q, k_cache, v_cache, tables[0], 32, 0.2, dest) is dest
    )
    expected = naive_attention(q, k_cache, v_cache, tables[0], 40, torch.arange(32, 40), 0.2)
    check(dest, expected, torch.float32)
    with pytest.raises(ValueError, match="does not cover"):
        native.paged_prefill_attention_native(q, k_cache, v_cache, tables[0, :2], 32, 0.2)
    bad = tables[0].clone()
    bad[0] = -1
    with pytest.raises(ValueError, match="outside the cache"):
        native.paged_prefill_attention_native(q, k_cache, v_cache, bad, 32, 0.2)


@needs_compiler
def test_engine_prefill_choice():
    k_cache = torch.zeros(4, 16, 2, 64)
    q = torch.zeros(300, 6, 64)
    # float32 and bf16 caches take the compiled kernel, with or without a cached prefix.
    assert cpu_attention.prefill_in_place(q, k_cache)
    assert cpu_attention.prefill_in_place(q.bfloat16(), k_cache.bfloat16())
    assert not cpu_attention.prefill_in_place(q.half(), k_cache.half())


@needs_compiler
def test_build_is_cached_per_source_and_host(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEINFER_CACHE_DIR", str(tmp_path))
    first = native_build.build("paged_decode_attention")
    assert first.parent == tmp_path / "kernels" and first.exists()
    stamp = first.stat().st_mtime_ns
    assert native_build.build("paged_decode_attention") == first  # no second compile
    assert first.stat().st_mtime_ns == stamp
    assert not list(first.parent.glob(".*"))  # no temporary left behind


def test_each_target_builds_its_own_library(tmp_path, monkeypatch):
    require_native("skinny_gemm")
    monkeypatch.setenv("EDGEINFER_CACHE_DIR", str(tmp_path))
    native = native_build.build("skinny_gemm", "native")
    v3 = native_build.build("skinny_gemm", "x86-64-v3")
    assert native != v3 and "x86-64-v3" in v3.name and "x86-64-v3" not in native.name
    monkeypatch.setenv(native_build.ENV_MARCH, "x86-64-v3")
    assert native_build.build("skinny_gemm") == v3  # the environment names the default target
    # A bench's variant (-D) is a library of its own beside the one the engine loads.
    variant = native_build.build("skinny_gemm", "x86-64-v3", ("EDGEINFER_BF16_TILE_PANELS=8",))
    assert variant not in (native, v3) and variant.exists()


@pytest.fixture
def at_march(request, monkeypatch):
    """Every kernel wrapper loading its library built for ``request.param``."""
    march = request.param
    require_native(*KERNELS, march=march)
    wrappers = (skinny_gemm._kernel, decoder_pointwise._library)
    wrappers += (native._decode_kernel, native._prefill_kernel)
    monkeypatch.setenv(native_build.ENV_MARCH, march)
    for cached in wrappers:
        cached.cache_clear()
    yield march
    monkeypatch.undo()
    for cached in wrappers:
        cached.cache_clear()


@pytest.mark.parametrize("at_march", native_build.MARCHES, indirect=True)
def test_every_kernel_at_every_target(at_march):
    # The same sources built for SSE4.2 (v2), AVX2 (v3) and this CPU: each against torch.
    gen = torch.Generator().manual_seed(0)
    for rows in range(1, skinny_gemm.max_rows() + 1):
        for out_f, in_f in ((960, 576), (37, 100), (5, 17)):
            w, x = torch.randn(out_f, in_f, generator=gen), torch.randn(rows, in_f, generator=gen)
            b = torch.randn(out_f, generator=gen)
            prepared = skinny_gemm.prepare(w)
            assert prepared is not None
            got = skinny_gemm.skinny_linear(x, prepared, b)
            expected = torch.nn.functional.linear(x.double(), w.double(), b.double())
            torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)
            # bf16-valued float32 weights: panels held in bf16, the float32 kernel's result
            w16 = w.bfloat16().float()
            halved = skinny_gemm.prepare(w16)
            full = skinny_gemm.prepare(w16, halve=False)
            assert halved is not None and halved.halved and full is not None
            got = skinny_gemm.skinny_linear(x, halved, b)
            assert torch.equal(got, skinny_gemm.skinny_linear(x, full, b))
    # bfloat16 weights: the AVX512-BF16 kernel where the target has it; v2 and v3 build without
    if at_march != "native":
        assert not skinny_gemm.takes_bf16()
        assert skinny_gemm.prepare(torch.randn(32, 16).bfloat16()) is None
    elif skinny_gemm.takes_bf16():
        w, x = torch.randn(37, 101, generator=gen).bfloat16(), torch.randn(3, 101, generator=gen)
        prepared = skinny_gemm.prepare(w)
        assert prepared is not None
        got = skinny_gemm.skinny_linear(x.bfloat16(), prepared)
        expected = torch.nn.functional.linear(x.bfloat16().double(), w.double())
        torch.testing.assert_close(got.double(), expected, rtol=2**-8, atol=1e-3)
    for dtype in (torch.float32, torch.bfloat16):
        tol = (
            {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
        )
        x = torch.randn(7, 64, generator=gen).to(dtype)
        delta = torch.randn(7, 64, generator=gen).to(dtype)
        weight = (1 + 0.1 * torch.randn(64, generator=gen)).to(dtype)
        total, normed = decoder_pointwise.add_rms_norm(x, delta, weight, 1e-5)
        reference = torch.nn.functional.rms_norm((x + delta).float(), (64,), weight.float(), 1e-5)
        torch.testing.assert_close(total, x + delta)
        torch.testing.assert_close(normed.float(), reference, **tol)
        gate_up = torch.randn(7, 128, generator=gen).to(dtype)
        gate, up = gate_up.float().chunk(2, dim=-1)
        silu = torch.nn.functional.silu(gate) * up
        torch.testing.assert_close(decoder_pointwise.silu_mul(gate_up).float(), silu, **tol)
        qk = torch.randn(7, 4, 64, generator=gen).to(dtype)
        emb = torch.rand(7, 32, generator=gen).repeat(1, 2) * 10
        rot = Rotation.build(emb.cos(), emb.sin(), dtype)
        expected_qk = rot.apply(qk)
        torch.testing.assert_close(
            decoder_pointwise.rotate_(qk, rot.cos, rot.signed_sin), expected_qk, **tol
        )
        k_cache, v_cache, tables, lens = make_cache(LENGTHS, 2, 64, 16, dtype)
        q = torch.randn(len(LENGTHS), 6, 64).to(dtype)
        out = native.paged_decode_attention_native(q, k_cache, v_cache, tables, lens, 0.125)
        check(out, naive_decode(q, k_cache, v_cache, tables, lens, 0.125), dtype)
        k_cache, v_cache, tables, _ = make_cache([42], 2, 64, 16, dtype)
        q = torch.randn(37, 6, 64).to(dtype)
        out = native.paged_prefill_attention_native(q, k_cache, v_cache, tables[0], 5, 0.125)
        qpos = torch.arange(5, 42)
        check(out, naive_attention(q, k_cache, v_cache, tables[0], 42, qpos, 0.125), dtype)


@needs_compiler
def test_loading_keeps_subnormal_floats():
    # Linking with -ffast-math would add crtfastmath.o, which turns on flush-to-zero for the
    # whole process when the library loads: every float op elsewhere would change.
    assert native.available()
    tiny = np.array([1e-39], dtype=np.float32)  # a subnormal float32
    assert (tiny * np.float32(1.0))[0] != 0
    assert (torch.tensor([1e-39]) * 1.0).item() != 0


def test_a_failed_build_falls_back_with_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("EDGEINFER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that fails every build
    native_build.clear_cache()
    try:
        with caplog.at_level(logging.WARNING, logger=native_build.__name__):
            assert native_build.load("paged_decode_attention") is None
        assert "using the portable one" in caplog.text
        assert "failed" in (native_build.load_error("paged_decode_attention") or "")
        assert not list((tmp_path / "kernels").iterdir())  # nothing half-built kept
    finally:
        native_build.clear_cache()


def test_a_failed_build_fails_the_tests_instead_of_skipping_them(tmp_path, monkeypatch):
    # With a compiler present, a kernel that no longer compiles must not read as "skipped".
    monkeypatch.setenv("EDGEINFER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    monkeypatch.setenv(native_build.ENV_SWITCH, "1")
    native_build.clear_cache()
    try:
        with pytest.raises(native_build.NativeBuildError, match="failed"):
            require_native("skinny_gemm")
    finally:
        native_build.clear_cache()


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv(native_build.ENV_SWITCH, "0")
    native_build.clear_cache()
    try:
        assert native_build.load("paged_decode_attention") is None
        assert "switched off" in (native_build.load_error("paged_decode_attention") or "")
    finally:
        native_build.clear_cache()


def test_engine_without_the_native_kernel_matches_hf(tmp_path, monkeypatch):
    # The portable path a host without a compiler takes: numba's kernel for wide KV heads,
    # torch's plan for narrow ones (this checkpoint's), torch's flash kernel for prefill; still
    # token for token with HF.
    monkeypatch.setattr(native, "available", lambda: False)
    monkeypatch.setattr(native, "supports", lambda q, k_cache: False)
    # ... and torch's pointwise ops, oneDNN for every projection.
    monkeypatch.setattr(decoder_pointwise, "supports", lambda x: False)
    monkeypatch.setattr(skinny_gemm, "prepare", lambda weight: None)
    assert not cpu_attention.prefill_in_place(torch.zeros(4, 2, 16), torch.zeros(1, 16, 1, 16))
    assert not cpu_attention.decode_in_place(torch.float32, 64)
    assert cpu_attention.decode_in_place(torch.float32, 512)
    path = build_tiny_checkpoint(tmp_path / "ckpt")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = random_prompts(6, hf.config.vocab_size, max_len=200, seed=3)
    engine = LLMEngine(EngineConfig(model=str(path), max_num_batched_tokens=256))
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0)
    with torch.inference_mode():
        for i, (prompt, out) in enumerate(zip(prompts, engine.generate(prompts, params))):
            assert_matches(out.token_ids, hf_greedy(hf, prompt, 8), f"prompt {i}")
