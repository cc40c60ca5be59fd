"""The compiled few-row matmul (decode of one or two sequences) against torch, and the engine's
routing of such steps to it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from edgeinfer.daemon.engine import linear as linear_module
from edgeinfer.daemon.engine.linear import Linear, skinny_copy
from edgeinfer.kernels import native_build, skinny_gemm

needs_kernel = pytest.mark.skipif(
    native_build.compiler() is None or not skinny_gemm.available(),
    reason="no C++ compiler here (or EDGEINFER_NATIVE_KERNELS=0): oneDNN serves every step",
)


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """float64 products of the same (possibly bf16) values."""
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize(
    ("out_features", "in_features"),
    [(960, 576), (37, 100), (5, 17), (8, 16)],  # whole tiles, then tails of rows and columns
)
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_matches_torch(dtype, rows, out_features, in_features, bias):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    w = torch.randn(out_features, in_features, generator=gen).to(dtype)
    b = torch.randn(out_features, generator=gen).to(dtype) if bias else None
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    y = skinny_gemm.skinny_linear(x, w, b)
    assert y.shape == (rows, out_features) and y.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(y.double(), reference(x, w, b), rtol=1e-5, atol=1e-4)
    else:  # float32 sums of exact bf16 products, rounded once to bf16
        expected = reference(x, w, b).float().to(torch.bfloat16)
        torch.testing.assert_close(y, expected, rtol=2**-7, atol=1e-2)


@needs_kernel
def test_skinny_linear_takes_views_and_leading_dims():
    w = torch.randn(24, 32)
    wide = torch.randn(2, 1, 48)
    x = wide[..., 8:40]  # rows strided, columns contiguous
    torch.testing.assert_close(skinny_gemm.skinny_linear(x, w), F.linear(x, w))
    empty = skinny_gemm.skinny_linear(torch.empty(0, 32), w)
    assert empty.shape == (0, 24)


@needs_kernel
def test_skinny_linear_rejects_what_it_cannot_take():
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match="rows"):
        skinny_gemm.skinny_linear(torch.randn(5, 16), w)
    with pytest.raises(ValueError, match="does not fit"):
        skinny_gemm.skinny_linear(torch.randn(1, 15), w)
    with pytest.raises(ValueError, match="does not fit"):
        skinny_gemm.skinny_linear(torch.randn(1, 16).double(), w)
    with pytest.raises(ValueError, match="bias"):
        skinny_gemm.skinny_linear(torch.randn(1, 16), w, torch.randn(7))
    with pytest.raises(ValueError, match="contiguous 2-D"):
        skinny_gemm.skinny_linear(torch.randn(1, 8), w.t())
    with pytest.raises(ValueError, match="contiguous 2-D"):
        skinny_gemm.skinny_linear(torch.randn(1, 16, dtype=torch.float16), w.half())


@needs_kernel
def test_packed_layers_send_one_or_two_rows_to_the_kernel(monkeypatch):
    monkeypatch.setattr(linear_module, "ONEDNN_MIN_FLOAT32_WEIGHT", 0)
    layer = Linear(64, 48)
    x = torch.randn(8, 64)
    with torch.no_grad():
        expected = layer(x)
        layer.pack()
    if layer.packed is None:
        pytest.skip("torch without oneDNN: nothing is packed")
    assert layer.plain is not None and layer.plain.data_ptr() == layer.weight.data_ptr()
    calls = []
    real = skinny_gemm.skinny_linear
    monkeypatch.setattr(
        skinny_gemm, "skinny_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a)
    )
    with torch.no_grad():
        for rows in (1, 2, 3, 8):
            got = layer(x[:rows])
            torch.testing.assert_close(got, expected[:rows], rtol=1e-5, atol=1e-5)
    assert calls == [1, 2]  # three rows and more stay on oneDNN


def test_only_float32_weights_get_a_plain_copy():
    assert skinny_copy(torch.randn(8, 16, dtype=torch.bfloat16)) is None
    assert skinny_copy(torch.randn(8, 16, dtype=torch.float16)) is None
    if skinny_gemm.available():
        assert skinny_copy(torch.randn(8, 16)) is not None
