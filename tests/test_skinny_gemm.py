"""The compiled few-row matmul (decode steps of up to eight sequences) against torch, in float32
and (where the build has AVX512-BF16) bfloat16, and the engine's routing of such steps to it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from edgeinfer.daemon.engine import linear as linear_module
from edgeinfer.daemon.engine.linear import Linear
from edgeinfer.kernels import skinny_gemm
from native_helpers import require_native


@pytest.fixture(autouse=True)
def _built() -> None:
    require_native("skinny_gemm")  # skips without a compiler; a failed build fails


@pytest.mark.parametrize("rows", list(range(1, 9)))
@pytest.mark.parametrize(
    ("out_features", "in_features"),
    # whole tiles of panels; a partial last panel and leftover panels; tiny; one panel
    [(960, 576), (37, 100), (5, 17), (16, 8)],
)
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_matches_torch(rows, out_features, in_features, bias):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    w = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    x = torch.randn(rows, in_features, generator=gen)
    prepared = skinny_gemm.prepare(w)
    assert prepared is not None
    y = skinny_gemm.skinny_linear(x, prepared, b)
    assert y.shape == (rows, out_features) and y.dtype == torch.float32
    expected = F.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_thread_count_covers_every_panel(threads):
    w, x = torch.randn(200, 64), torch.randn(3, 64)
    prepared = skinny_gemm.prepare(w)
    assert prepared is not None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = skinny_gemm.skinny_linear(x, prepared)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_skinny_linear_takes_views_and_leading_dims():
    w = torch.randn(24, 32)
    prepared = skinny_gemm.prepare(w)
    assert prepared is not None
    x = torch.randn(2, 1, 48)[..., 8:40]  # rows strided, columns contiguous
    torch.testing.assert_close(skinny_gemm.skinny_linear(x, prepared), F.linear(x, w))
    assert skinny_gemm.skinny_linear(torch.empty(0, 32), prepared).shape == (0, 24)


@pytest.mark.parametrize("rows", list(range(1, 9)))
@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (37, 100), (5, 17)])
def test_float32_weights_of_a_bf16_checkpoint_are_held_in_half_the_bytes(
    rows, out_features, in_features
):
    # A float32 model loaded from a bf16 checkpoint: every weight a bf16 value.
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    w = torch.randn(out_features, in_features, generator=gen).bfloat16().float()
    b = torch.randn(out_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    halved, full = skinny_gemm.prepare(w), skinny_gemm.prepare(w, halve=False)
    assert halved is not None and full is not None
    assert halved.halved and halved.panels.dtype == torch.bfloat16
    assert not full.halved and full.panels.dtype == torch.float32
    assert halved.panels.nbytes * 2 == full.panels.nbytes
    y = skinny_gemm.skinny_linear(x, halved, b)
    assert y.dtype == torch.float32
    # the same products summed in the same order: bit for bit the float32 kernel's result
    assert torch.equal(y, skinny_gemm.skinny_linear(x, full, b))
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_a_weight_that_is_not_bf16_exact_keeps_float32_panels():
    w = torch.randn(40, 24).bfloat16().float()
    assert skinny_gemm.bf16_exact(w)
    w[3, 5] += 2**-20  # one value bf16 cannot hold
    assert not skinny_gemm.bf16_exact(w)
    prepared = skinny_gemm.prepare(w)
    assert prepared is not None and not prepared.halved
    x = torch.randn(2, 24)
    torch.testing.assert_close(skinny_gemm.skinny_linear(x, prepared), F.linear(x, w))


def _bf16_built() -> None:
    if not skinny_gemm.takes_bf16():
        pytest.skip("this build has no AVX512-BF16: bfloat16 weights stay on oneDNN")


@pytest.mark.parametrize("rows", list(range(1, 9)))
@pytest.mark.parametrize(
    ("out_features", "in_features"),
    # whole tiles; a partial last panel and an odd input count; tiny; one panel; the LM head's
    [(960, 576), (37, 101), (5, 17), (16, 8), (1000, 64)],
)
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_skinny_linear_matches_torch(rows, out_features, in_features, bias):
    _bf16_built()
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    w = torch.randn(out_features, in_features, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    prepared = skinny_gemm.prepare(w)
    assert prepared is not None and prepared.panels.dtype == torch.bfloat16
    y = skinny_gemm.skinny_linear(x, prepared, b)
    assert y.shape == (rows, out_features) and y.dtype == torch.bfloat16
    # float32 sums of exact products, rounded once to bfloat16: within half a bf16 step of the
    # exact result, as torch's own bf16 linear is
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    tol = {"rtol": 2**-8, "atol": 1e-3}
    torch.testing.assert_close(y.double(), exact, **tol)
    torch.testing.assert_close(y.double(), F.linear(x, w, b).double(), rtol=2**-7, atol=1e-3)


def test_bf16_takes_views_and_refuses_float32_input():
    _bf16_built()
    w = torch.randn(24, 33).bfloat16()
    prepared = skinny_gemm.prepare(w)
    assert prepared is not None
    x = torch.randn(2, 1, 50).bfloat16()[..., 8:41]  # rows strided, columns contiguous
    expected = F.linear(x.double(), w.double())
    torch.testing.assert_close(
        skinny_gemm.skinny_linear(x, prepared).double(), expected, rtol=2**-8, atol=1e-3
    )
    with pytest.raises(ValueError, match="does not fit"):
        skinny_gemm.skinny_linear(torch.randn(1, 33), prepared)
    with pytest.raises(ValueError, match="bias"):
        skinny_gemm.skinny_linear(x, prepared, torch.randn(24))


def test_what_it_cannot_take_is_refused():
    bf16 = skinny_gemm.prepare(torch.randn(8, 16, dtype=torch.bfloat16))
    assert (bf16 is not None) == skinny_gemm.takes_bf16()
    assert skinny_gemm.prepare(torch.randn(8, 16, dtype=torch.float16)) is None
    assert skinny_gemm.prepare(torch.randn(16)) is None
    assert skinny_gemm.prepare(torch.empty(0, 16)) is None
    prepared = skinny_gemm.prepare(torch.randn(8, 16))
    assert prepared is not None
    with pytest.raises(ValueError, match="rows"):
        skinny_gemm.skinny_linear(torch.randn(skinny_gemm.max_rows() + 1, 16), prepared)
    with pytest.raises(ValueError, match="does not fit"):
        skinny_gemm.skinny_linear(torch.randn(1, 15), prepared)
    with pytest.raises(ValueError, match="does not fit"):
        skinny_gemm.skinny_linear(torch.randn(1, 16).double(), prepared)
    with pytest.raises(ValueError, match="bias"):
        skinny_gemm.skinny_linear(torch.randn(1, 16), prepared, torch.randn(7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_layers_send_decode_steps_to_the_kernel(monkeypatch, dtype):
    if dtype == torch.bfloat16:
        _bf16_built()
    monkeypatch.setattr(linear_module, "ONEDNN_MIN_FLOAT32_WEIGHT", 0)
    layer = Linear(64, 48).to(dtype)
    x = torch.randn(12, 64).to(dtype)
    with torch.no_grad():
        expected = layer(x)
        layer.pack()
    if layer.packed is None:
        pytest.skip(f"torch without oneDNN (or its {dtype} matmul): nothing is packed")
    assert layer.skinny is not None and layer.weight.numel() == 0
    calls = []
    real = skinny_gemm.skinny_linear
    monkeypatch.setattr(
        skinny_gemm, "skinny_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a)
    )
    with torch.no_grad():
        for rows in (1, 2, 8, 9, 12):
            got = layer(x[:rows])
            assert got.dtype == dtype
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got, expected[:rows], rtol=tol, atol=tol)
    assert calls == [1, 2, 8]  # more rows than the kernel takes stay on oneDNN
