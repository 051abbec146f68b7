"""The C GEMM of linear layers (models/cpu_gemm.py) against torch's float64 product, and
its fallbacks when it cannot run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import models.opt
from models import cpu_gemm, cpu_kernels
from models.opt import Float32Linear

needs_kernel = pytest.mark.skipif(not cpu_gemm.is_available(), reason="no C compiler")


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, relu: bool,
              residual: torch.Tensor | None) -> torch.Tensor:
    out = F.linear(x.double(), w.double(), None if b is None else b.double())
    out = out.relu() if relu else out
    return out if residual is None else out + residual.double()


@needs_kernel
@pytest.mark.parametrize(("rows", "k", "n"), [
    (1, 64, 16), (7, 300, 50), (64, 768, 768), (200, 96, 33), (5, 513, 2304)])
@pytest.mark.parametrize("epilogue", ["bias", "none", "relu", "residual"])
def test_linear_matches_float64_product(rows: int, k: int, n: int, epilogue: str) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + k + n)
    x = torch.randn(rows, k, generator=g)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    bias = None if epilogue == "none" else b
    residual = torch.randn(rows, n, generator=g) if epilogue == "residual" else None
    out = cpu_gemm.linear(x, cpu_gemm.pack(w), n, bias, epilogue == "relu", residual)
    assert out is not None and out.shape == (rows, n) and out.dtype == torch.float32
    expected = reference(x, w, bias, epilogue == "relu", residual)
    # float32 accumulation over k terms of unit variance: error ~ sqrt(k) * eps * |terms|
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-5 * k ** 0.5)
    if epilogue == "relu":
        assert (out >= 0).all()


@needs_kernel
def test_linear_reads_strided_rows_and_keeps_nan_through_relu() -> None:
    g = torch.Generator().manual_seed(3)
    wide, w = torch.randn(9, 3 * 64, generator=g), torch.randn(40, 64, generator=g)
    x = wide[:, 64:128]  # rows 192 floats apart, as the q slice of a fused QKV output
    x[2, 5] = float("nan")
    out = cpu_gemm.linear(x, cpu_gemm.pack(w), 40, None, relu=True)
    assert out is not None
    assert out[2].isnan().all() and not out[[0, 1, 3]].isnan().any()
    torch.testing.assert_close(out[[0, 1, 3]].double(),
                               reference(x[[0, 1, 3]], w, None, True, None),
                               rtol=0, atol=1e-4)


@needs_kernel
def test_linear_declines_what_it_cannot_run_and_rejects_a_wrong_weight() -> None:
    w = torch.randn(32, 16)
    assert cpu_gemm.linear(torch.randn(2, 16, dtype=torch.float64), cpu_gemm.pack(w), 32) is None
    with pytest.raises(ValueError, match=r"packed weight \(2, 16, 16\) does not fit input "
                                         r"\(2, 8\) and 32 outputs"):
        cpu_gemm.linear(torch.randn(2, 8), cpu_gemm.pack(w), 32)


def test_kernels_switched_off_build_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASERVE_CPU_KERNELS", "0")
    assert cpu_kernels.build("gemm", "int gemm(void) { return 0; }") is None


def test_broken_source_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("ASERVE_CACHE_DIR", str(tmp_path))
    assert cpu_kernels.build("broken", "this is not C") is None


@pytest.mark.parametrize("available", [True, False])
def test_float32_linear_matches_torch_with_and_without_the_kernel(
        monkeypatch: pytest.MonkeyPatch, available: bool) -> None:
    if available and not cpu_gemm.is_available():
        pytest.skip("no C compiler")
    monkeypatch.setattr(cpu_gemm, "is_available", lambda: available)
    monkeypatch.setattr(models.opt, "PACK_MIN_WEIGHTS", 0)
    torch.manual_seed(0)
    fc = nn.Linear(96, 130)
    layer = Float32Linear.of(fc)
    expected_kernel = ("gemm" if available else
                       "onednn" if torch.backends.mkldnn.is_available() else "torch")
    assert layer.kernel == expected_kernel
    x, residual = torch.randn(11, 96), torch.randn(11, 130)
    with torch.inference_mode():
        want = fc(x)
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer(x, relu=True), want.relu(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer(x, residual=residual), want + residual,
                                   rtol=1e-5, atol=1e-5)
        half = layer(x.bfloat16(), residual=residual.bfloat16())  # bf16 model, bf16 stream
        assert half.dtype == torch.bfloat16
        torch.testing.assert_close(half.float(), want + residual, rtol=2e-2, atol=5e-2)


@needs_kernel
def test_bf16_panels_compute_what_their_float32_widening_does() -> None:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(70, 300, generator=g).bfloat16()
    x, b = torch.randn(13, 300, generator=g), torch.randn(70, generator=g)
    packed = cpu_gemm.pack(w)
    assert packed.dtype == torch.bfloat16  # half the bytes, no float32 copy
    out = cpu_gemm.linear(x, packed, 70, b, relu=True)
    same = cpu_gemm.linear(x, cpu_gemm.pack(w.float()), 70, b, relu=True)
    assert out is not None and same is not None and torch.equal(out, same)  # exact widening
    torch.testing.assert_close(out.double(), reference(x, w.float(), b, True, None),
                               rtol=0, atol=2e-5 * 300 ** 0.5)
