"""The C GEMM of linear layers (models/cpu_gemm.py) against torch's float64 product, and
its fallbacks when it cannot run."""

from __future__ import annotations

import multiprocessing
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import models.opt
from models import cpu_gemm, cpu_isa, cpu_kernels, measure
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
@pytest.mark.parametrize("threads", [1, 2, 5])
def test_linear_with_any_number_of_threads_matches_float64(threads: int) -> None:
    """The kernel's helper threads (kept between calls) split the panels between them; more
    threads than panels or than cores leaves some idle, never a wrong sum."""
    g = torch.Generator().manual_seed(threads)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows, k, n in [(64, 768, 768), (3, 40, 16), (200, 96, 33)]:
            x, w, b = (torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g),
                       torch.randn(n, generator=g))
            out = cpu_gemm.linear(x, cpu_gemm.pack(w), n, b, relu=True)
            assert out is not None
            torch.testing.assert_close(out.double(), reference(x, w, b, True, None),
                                       rtol=0, atol=2e-5 * k ** 0.5)
    finally:
        torch.set_num_threads(saved)


@needs_kernel
def test_linear_called_from_several_threads_at_once_matches_float64() -> None:
    """ctypes lets go of the GIL: calls from two Python threads overlap in the kernel, and
    one of them finds the helper threads busy with the other's job."""
    g = torch.Generator().manual_seed(4)
    cases = []
    for n in (768, 2304, 80):
        x, w = torch.randn(64, 768, generator=g), torch.randn(n, 768, generator=g)
        cases.append((x, cpu_gemm.pack(w), n, reference(x, w, None, False, None)))

    def work(case: tuple) -> float:
        x, packed, n, expected = case
        worst = 0.0
        for _ in range(20):
            out = cpu_gemm.linear(x, packed, n)
            assert out is not None
            worst = max(worst, (out.double() - expected).abs().max().item())
        return worst

    with ThreadPoolExecutor(len(cases)) as pool:
        errors = list(pool.map(work, cases))
    assert max(errors) < 2e-5 * 768 ** 0.5


def _linear_in_child(queue: multiprocessing.Queue) -> None:
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(64, 256, generator=g), torch.randn(512, 256, generator=g)
    out = cpu_gemm.linear(x, cpu_gemm.pack(w), 512)
    queue.put(None if out is None else (out.double() - reference(x, w, None, False, None))
              .abs().max().item())


@needs_kernel
@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
def test_linear_works_in_a_forked_child_after_the_parent_used_it() -> None:
    """A forked child has none of its parent's helper threads (nor their locks): its calls
    still finish, with the right sums."""
    x, w = torch.randn(64, 256), torch.randn(512, 256)
    assert cpu_gemm.linear(x, cpu_gemm.pack(w), 512) is not None  # the parent's helpers exist
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_linear_in_child, args=(queue,))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == 0, "the child hung or failed"
    error = queue.get(timeout=5)
    assert error is not None and error < 2e-5 * 256 ** 0.5


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


def shifted_layer_norm(width: int, affine: bool, seed: int) -> nn.LayerNorm:
    """A LayerNorm with random (not unit) weight and bias where `affine`."""
    norm = nn.LayerNorm(width, elementwise_affine=affine)
    if affine:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(width, generator=g))
            norm.bias.copy_(torch.randn(width, generator=g))
    return norm


@needs_kernel
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("epilogue", ["relu", "residual"])
def test_layer_norm_in_the_input_pass_matches_float64(affine: bool, epilogue: str) -> None:
    g = torch.Generator().manual_seed(11)
    rows, k, n = 9, 300, 70
    # rows far from zero mean and unit variance, read through a stride (a view of a wider x)
    x = (torch.randn(rows, k + 40, generator=g) * 4 + 3)[:, 20:20 + k]
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    residual = torch.randn(rows, n, generator=g) if epilogue == "residual" else None
    norm = shifted_layer_norm(k, affine, seed=12)
    with torch.inference_mode():
        out = cpu_gemm.linear(x, cpu_gemm.pack(w), n, b, epilogue == "relu", residual, norm)
        expected = reference(norm.double()(x.double()), w, b, epilogue == "relu", residual)
    assert out is not None
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=5e-5 * k ** 0.5)


@needs_kernel
def test_layer_norm_of_another_width_is_refused() -> None:
    w = torch.randn(32, 16)
    with pytest.raises(ValueError, match="LayerNorm"):
        cpu_gemm.linear(torch.randn(2, 16), cpu_gemm.pack(w), 32, norm=nn.LayerNorm(8))


@pytest.mark.parametrize("available", [True, False])
@pytest.mark.parametrize("affine", [True, False])
def test_float32_linear_with_a_norm_matches_torch_with_and_without_the_kernel(
        monkeypatch: pytest.MonkeyPatch, available: bool, affine: bool) -> None:
    if available and not cpu_gemm.is_available():
        pytest.skip("no C compiler")
    monkeypatch.setattr(cpu_gemm, "is_available", lambda: available)
    monkeypatch.setattr(models.opt, "PACK_MIN_WEIGHTS", 0)
    torch.manual_seed(1)
    fc, norm = nn.Linear(96, 130), shifted_layer_norm(96, affine, seed=2)
    layer = Float32Linear.of(fc)
    x = torch.randn(11, 96) * 2 + 1
    with torch.inference_mode():
        want = fc(norm(x))
        torch.testing.assert_close(layer(x, norm=norm), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer(x, relu=True, norm=norm), want.relu(), rtol=1e-5,
                                   atol=1e-5)
        torch.testing.assert_close(models.opt.linear_norm(fc, x, norm), want)  # nn.Linear


def test_huge_page_advice_covers_the_aligned_interior_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int, int]] = []
    size = 2 << 20
    monkeypatch.setattr(cpu_kernels, "_madvise",
                        lambda: (lambda a, n, advice: calls.append((a, n, advice)) or 0, size))
    big = torch.empty(3 * size + 12345, dtype=torch.uint8)
    assert cpu_kernels.advise_huge_pages(big)
    (start, length, advice), = calls
    assert advice == cpu_kernels.MADV_HUGEPAGE and start % size == 0 and length % size == 0
    assert big.data_ptr() <= start and start + length <= big.data_ptr() + big.numel()
    assert length >= 2 * size
    assert not cpu_kernels.advise_huge_pages(torch.empty(100))  # under one huge page
    assert len(calls) == 1


def test_huge_page_advice_keeps_contents_and_can_be_switched_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    t = torch.randn(1 << 20)  # 4 MiB
    before = t.clone()
    cpu_kernels.advise_huge_pages(t)  # True or False depending on the host: never an error
    assert torch.equal(t, before)
    monkeypatch.setenv("ASERVE_HUGE_PAGES", "0")
    cpu_kernels._madvise.cache_clear()
    try:
        assert not cpu_kernels.advise_huge_pages(t)
    finally:
        monkeypatch.undo()
        cpu_kernels._madvise.cache_clear()


def test_packed_panels_do_not_depend_on_huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(300, 200)
    with_advice = cpu_gemm.pack(w)
    monkeypatch.setattr(cpu_kernels, "advise_huge_pages", lambda t: False)
    without = cpu_gemm.pack(w)
    assert torch.equal(with_advice, without)
    assert torch.equal(with_advice[1, :, 3], w[16 + 3])  # panel 1, column 3 = output row 19


SPINNING = """
import torch
from models import cpu_gemm
torch.manual_seed(0)
torch.set_num_threads(2)
w = torch.randn(300, 96)
packed = cpu_gemm.pack(w)
for rows in [1, 7, 64] * 20:  # back-to-back calls: helpers spinning for the next job
    x = torch.randn(rows, 96)
    out = cpu_gemm.linear(x, packed, 300)
    assert out is not None and torch.allclose(out, x @ w.T, rtol=1e-5, atol=1e-5)
print("ok")
"""


@needs_kernel
@pytest.mark.parametrize("waits", [{"GOMP_SPINCOUNT": "10000"}, {"OMP_WAIT_POLICY": "PASSIVE"}])
def test_helpers_that_spin_or_sleep_between_calls_compute_the_same(waits: dict[str, str]
                                                                   ) -> None:
    """The helpers spin for the next job before they sleep (GOMP_SPINCOUNT), or sleep at
    once (OMP_WAIT_POLICY=PASSIVE, as `make test` runs); both give torch's product."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", SPINNING], capture_output=True, text=True,
                         env={**env, **waits}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@needs_kernel
@pytest.mark.parametrize(("faster", "dtype"), [("onednn", torch.float32),
                                               ("gemm", torch.float32),
                                               ("onednn", torch.bfloat16),
                                               ("gemm", torch.bfloat16)])
def test_float32_linear_takes_the_gemm_measured_faster_once_per_shape(
        monkeypatch: pytest.MonkeyPatch, faster: str, dtype: torch.dtype) -> None:
    """Products of WIDE_ROWS rows or more take the GEMM the weight's first forward times
    faster (here a fake clock says which), every layer of its shape and dtype the same
    without timing again; fewer rows keep the C GEMM (a bf16 weight's bf16 panels). Either
    way the outputs are torch's on the float32 widening of the weight. Without oneDNN
    nothing is timed and every product takes the C GEMM."""
    timed: list[str] = []

    def fake_timed(product: Callable[[], object]) -> tuple[float, object]:
        timed.append(product.__name__)
        return (1.0 if product.__name__ == faster else 2.0), product()

    monkeypatch.setattr(measure, "timed", fake_timed)
    monkeypatch.setattr(models.opt, "_float32_kernels", {})
    monkeypatch.setattr(models.opt, "PACK_MIN_WEIGHTS", 0)
    torch.manual_seed(3)
    fcs = [nn.Linear(96, 130).to(dtype) for _ in range(2)]
    layers = [Float32Linear.of(fc) for fc in fcs]
    with torch.inference_mode():
        for rows in (models.opt.WIDE_ROWS, 1, 40):
            x, residual = torch.randn(rows, 96), torch.randn(rows, 130)
            for fc, layer in zip(fcs, layers):
                want = F.linear(x, fc.weight.float(), fc.bias.float())
                torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(layer(x, relu=True), want.relu(), rtol=1e-5,
                                           atol=1e-5)
                torch.testing.assert_close(layer(x, residual=residual), want + residual,
                                           rtol=1e-5, atol=1e-5)
    choosing = torch.backends.mkldnn.is_available()
    wide = choosing and faster == "onednn"
    assert [layer.kernel for layer in layers] == ["gemm", "gemm"]
    assert [layer.wide is not None for layer in layers] == [wide, wide]
    assert all(layer.wide is None or layer.wide.dtype == torch.float32 for layer in layers)
    rounds = len(models.opt.CHOICE_ROWS) * models.opt.CHOICE_TRIALS * choosing
    assert sorted(timed) == ["gemm"] * rounds + ["onednn"] * rounds  # the first layer only
    c_rows: list[int] = []  # the row counts the C GEMM computes from here on
    c_gemm = cpu_gemm.linear
    monkeypatch.setattr(cpu_gemm, "linear",
                        lambda x, *a, **k: c_rows.append(x.shape[0]) or c_gemm(x, *a, **k))
    with torch.inference_mode():
        for rows in (1, models.opt.WIDE_ROWS - 1, models.opt.WIDE_ROWS, 64):
            layers[1](torch.randn(rows, 96))
    assert c_rows == [1, models.opt.WIDE_ROWS - 1] + (
        [] if wide else [models.opt.WIDE_ROWS, 64])


@needs_kernel
def test_kernels_compile_for_the_cpu_named_in_aserve_march(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """ASERVE_MARCH=haswell builds AVX2 code on any x86 CPU (its own library in the cache;
    elsewhere the compiler refuses it and the kernel is not built); unset, the kernels use
    all of this CPU's vector registers."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    monkeypatch.setenv("ASERVE_CACHE_DIR", str(tmp_path))
    source = "int lanes(void) {\n#ifdef __AVX512F__\nreturn 16;\n#else\nreturn 8;\n#endif\n}\n"
    native_lanes = 16 if "avx512f" in cpu_isa.cpu_flags().split() else 8
    for march, lanes in (("", native_lanes), ("haswell", 8 if x86 else None)):
        monkeypatch.setenv("ASERVE_MARCH", march)
        lib = cpu_kernels.build("lanes", source, [])
        assert (lib is None) if lanes is None else (lib is not None and lib.lanes() == lanes)
    assert len(list(tmp_path.glob("lanes_*.so"))) == (2 if x86 else 1)
