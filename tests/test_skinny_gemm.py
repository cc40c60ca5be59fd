"""The compiled few-row matmul (decode steps of up to eight sequences) against torch, and the
engine's routing of such steps to it."""

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


def test_what_it_cannot_take_is_refused():
    assert skinny_gemm.prepare(torch.randn(8, 16, dtype=torch.bfloat16)) is None
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


def test_packed_layers_send_decode_steps_to_the_kernel(monkeypatch):
    monkeypatch.setattr(linear_module, "ONEDNN_MIN_FLOAT32_WEIGHT", 0)
    layer = Linear(64, 48)
    x = torch.randn(12, 64)
    with torch.no_grad():
        expected = layer(x)
        layer.pack()
    if layer.packed is None:
        pytest.skip("torch without oneDNN: nothing is packed")
    assert layer.skinny is not None and layer.weight.numel() == 0
    calls = []
    real = skinny_gemm.skinny_linear
    monkeypatch.setattr(
        skinny_gemm, "skinny_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a)
    )
    with torch.no_grad():
        for rows in (1, 2, 8, 9, 12):
            got = layer(x[:rows])
            torch.testing.assert_close(got, expected[:rows], rtol=1e-5, atol=1e-5)
    assert calls == [1, 2, 8]  # more rows than the kernel takes stay on oneDNN
