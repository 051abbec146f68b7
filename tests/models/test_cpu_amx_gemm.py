"""bf16 linear layers on AMX tiles (`models.cpu_amx_gemm`): the products of decode-sized row
counts, with every post-op `HalfLinear` fuses, against float32 products of the same bf16
inputs; what the kernel declines; and `HalfLinear` taking it only where it serves."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import models.opt
from models import cpu_amx_gemm
from models.opt import HalfLinear

pytestmark = pytest.mark.skipif(not cpu_amx_gemm.is_available(),
                                reason="needs a CPU with AMX and a C compiler")


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


@pytest.mark.parametrize("rows", [1, 17, 64, 100, cpu_amx_gemm.MAX_ROWS])
@pytest.mark.parametrize("shape", [(256, 512), (96, 1024)])
def test_products_and_post_ops_match_float32(rows: int, shape: tuple[int, int]) -> None:
    x, w, b, r = inputs(rows, *shape)
    packed = cpu_amx_gemm.pack(w)
    want = x.float() @ w.float().T + b.float()
    close(cpu_amx_gemm.linear(x, packed, b), want)
    close(cpu_amx_gemm.linear(x, packed, None), x.float() @ w.float().T)
    close(cpu_amx_gemm.linear(x, packed, b, "relu"), want.relu())
    close(cpu_amx_gemm.linear(x, packed, b, "add", r), want + r.float())


@pytest.mark.parametrize("rows", [3, 64, 80])
def test_silu_mul_runs_both_halves_of_a_gated_layer(rows: int) -> None:
    x, w, b, _ = inputs(rows, 2 * 192, 576, seed=1)
    gate, up = (x.float() @ w.float().T + b.float()).chunk(2, dim=-1)
    # SiLU(gate) is rounded to bf16, as a GEMM's output is, before the product
    want = F.silu(gate).bfloat16().float() * up
    got = cpu_amx_gemm.linear(x, cpu_amx_gemm.pack(w), b, "silu_mul")
    assert got is not None and got.shape == (rows, 192)
    assert ((got.float() - want).abs() <= 2 ** -6 * want.abs() + 2e-3).all()


def test_prompt_rows_other_dtypes_and_odd_shapes_are_declined() -> None:
    x, w, b, _ = inputs(cpu_amx_gemm.MAX_ROWS + 1, 64, 128)
    packed = cpu_amx_gemm.pack(w)
    assert cpu_amx_gemm.linear(x, packed, b) is None  # prompts: oneDNN
    assert cpu_amx_gemm.linear(x[:4].float(), packed, b) is None
    assert cpu_amx_gemm.linear(x[:4], packed, b.float()) is None
    assert not cpu_amx_gemm.fits(w[:40])  # not whole tiles of 16 features
    assert not cpu_amx_gemm.fits(w[:, :48])  # nor of 32 inputs
    assert not cpu_amx_gemm.fits(w.float())
    with pytest.raises(ValueError, match="input has 96 features, the weight takes 128"):
        cpu_amx_gemm.linear(x[:4, :96], packed, b)


def test_half_linear_takes_the_tiles_for_decode_rows_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models.opt, "PACK_MIN_WEIGHTS", 0)
    x, w, b, r = inputs(300, 128, 256, seed=2)
    layer = HalfLinear(w, b)
    assert layer.has_tiles
    close(layer(x[:9], residual=r[:9]), x[:9].float() @ w.float().T + b.float() + r[:9].float())
    assert layer.tiles is not None and layer.packed is None  # no oneDNN copy for decode
    close(layer(x, relu=True), (x.float() @ w.float().T + b.float()).relu())
    assert layer.packed is not None  # a prompt's rows: oneDNN
    monkeypatch.setattr(cpu_amx_gemm, "ENABLED", False)
    assert not HalfLinear(w, b).has_tiles  # ASERVE_AMX_GEMM=0
