"""bf16 linear layers for decode rows (`models.cpu_bf16_gemm`), on AMX tiles and with AVX-512
BF16 vectors (each where this CPU has it): the products of decode-sized row counts, with
every post-op `HalfLinear` fuses, against float32 products of the same bf16 inputs; what the
kernel declines; and `HalfLinear` taking it only where it serves."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import models.opt
from models import cpu_bf16_gemm
from models.opt import HalfLinear

pytestmark = pytest.mark.skipif(not cpu_bf16_gemm.is_available(),
                                reason="needs a CPU with AMX or AVX-512 BF16 and a C compiler")
# the kernels this CPU runs: tiles=True takes AMX where the CPU has it, False the vectors
PATHS = [pytest.param(True, id="tiles", marks=pytest.mark.skipif(
    not cpu_bf16_gemm.has_tiles(), reason="needs AMX")), pytest.param(False, id="vectors")]


def inputs(rows: int, out: int, inp: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, inp, generator=g).bfloat16()
    w = (torch.randn(out, inp, generator=g) * inp ** -0.5).bfloat16()
    b = torch.randn(out, generator=g).bfloat16()
    r = torch.randn(rows, out, generator=g).bfloat16()
    return x, w, b, r


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within a bf16 rounding of the float32 result (the kernel rounds once, at the end)."""
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert ((got.float() - want).abs() <= 2 ** -7 * want.abs() + 1e-3).all()


@pytest.mark.parametrize("tiles", PATHS)
@pytest.mark.parametrize("rows", [1, 3, 17, 64, 100, cpu_bf16_gemm.MAX_ROWS])
@pytest.mark.parametrize("shape", [(256, 512), (96, 1024), (80, 64), (16, 32)])
def test_products_and_post_ops_match_float32(rows: int, shape: tuple[int, int],
                                             tiles: bool) -> None:
    """Every row count against every block count: 16 and 6 blocks of 16 features (a whole
    and a partial group of four), 5, and 1 (the last block repeated in its group)."""
    x, w, b, r = inputs(rows, *shape)
    packed = cpu_bf16_gemm.pack(w)
    want = x.float() @ w.float().T + b.float()
    close(cpu_bf16_gemm.linear(x, packed, b, tiles=tiles), want)
    close(cpu_bf16_gemm.linear(x, packed, None, tiles=tiles), x.float() @ w.float().T)
    close(cpu_bf16_gemm.linear(x, packed, b, "relu", tiles=tiles), want.relu())
    close(cpu_bf16_gemm.linear(x, packed, b, "add", r, tiles=tiles), want + r.float())


@pytest.mark.parametrize("tiles", PATHS)
@pytest.mark.parametrize("rows", [3, 64, 80])
@pytest.mark.parametrize("features", [192, 208, 16])  # 12, 13 and 1 blocks per half
def test_silu_mul_runs_both_halves_of_a_gated_layer(rows: int, features: int,
                                                    tiles: bool) -> None:
    x, w, b, _ = inputs(rows, 2 * features, 576, seed=1)
    gate, up = (x.float() @ w.float().T + b.float()).chunk(2, dim=-1)
    # SiLU(gate) is rounded to bf16, as a GEMM's output is, before the product
    want = F.silu(gate).bfloat16().float() * up
    got = cpu_bf16_gemm.linear(x, cpu_bf16_gemm.pack(w), b, "silu_mul", tiles=tiles)
    assert got is not None and got.shape == (rows, features)
    assert ((got.float() - want).abs() <= 2 ** -6 * want.abs() + 2e-3).all()


@pytest.mark.parametrize("tiles", PATHS)
def test_a_row_gets_the_same_bits_whatever_rows_share_the_product(tiles: bool) -> None:
    """A sequence's logits do not depend on the batch it decodes in."""
    x, w, b, r = inputs(70, 96, 256, seed=3)
    packed = cpu_bf16_gemm.pack(w)
    whole = cpu_bf16_gemm.linear(x, packed, b, "add", r, tiles=tiles)
    assert whole is not None
    for rows in (slice(0, 1), slice(5, 6), slice(3, 20), slice(64, 70)):
        part = cpu_bf16_gemm.linear(x[rows], packed, b, "add", r[rows], tiles=tiles)
        assert part is not None and torch.equal(part, whole[rows])


def test_prompt_rows_other_dtypes_and_odd_shapes_are_declined() -> None:
    x, w, b, _ = inputs(cpu_bf16_gemm.MAX_ROWS + 1, 64, 128)
    packed = cpu_bf16_gemm.pack(w)
    assert cpu_bf16_gemm.linear(x, packed, b) is None  # prompts: oneDNN
    assert cpu_bf16_gemm.linear(x[:4].float(), packed, b) is None
    assert cpu_bf16_gemm.linear(x[:4], packed, b.float()) is None
    assert not cpu_bf16_gemm.fits(w[:40])  # not whole tiles of 16 features
    assert not cpu_bf16_gemm.fits(w[:, :48])  # nor of 32 inputs
    assert not cpu_bf16_gemm.fits(w.float())
    with pytest.raises(ValueError, match="input has 96 features, the weight takes 128"):
        cpu_bf16_gemm.linear(x[:4, :96], packed, b)


def test_half_linear_takes_the_kernel_for_decode_rows_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models.opt, "PACK_MIN_WEIGHTS", 0)
    x, w, b, r = inputs(300, 128, 256, seed=2)
    layer = HalfLinear(w, b)
    assert layer.has_decode_kernel
    close(layer(x[:9], residual=r[:9]), x[:9].float() @ w.float().T + b.float() + r[:9].float())
    assert layer.tiles is not None and layer.packed is None  # no oneDNN copy for decode
    close(layer(x, relu=True), (x.float() @ w.float().T + b.float()).relu())
    assert layer.packed is not None  # a prompt's rows: oneDNN
    monkeypatch.setattr(cpu_bf16_gemm, "ENABLED", False)
    assert not HalfLinear(w, b).has_decode_kernel  # ASERVE_BF16_GEMM=0
