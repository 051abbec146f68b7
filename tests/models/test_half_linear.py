"""Prepacked half-precision matmuls (`HalfLinear`): a bf16 model whose linear layers and LM
head run from oneDNN-packed weights computes what the same model computes with `F.linear`,
on OPT and on the Llama family, through prefill and decode steps."""

from __future__ import annotations

import pytest
import torch

import models.opt
from models.llama import PRESETS as LLAMA_PRESETS
from models.llama import LlamaConfig, LlamaForCausalLM
from models.loader import build_preset, build_random
from models.opt import HalfLinear, fit_matmuls_to
from tests.models.conftest import PagedRunner, random_prompts, rel_err

# oneDNN packs bf16 weights only where it has a bf16 path (AVX-512 BW/VL/DQ, AVX-NE-CONVERT
# or better); an AVX2-only CPU computes bf16 models in float32 (`fit_matmuls_to`)
pytestmark = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    reason="HalfLinear needs oneDNN's bf16 path")


def build(family: str, seed: int) -> torch.nn.Module:
    if family == "opt":
        return build_preset("opt-tiny", torch.bfloat16, "cpu", seed=seed).model
    cfg = LlamaConfig(**LLAMA_PRESETS["llama-tiny"], tie_word_embeddings=True)
    return build_random(cfg, LlamaForCausalLM, torch.bfloat16, "cpu", seed).model


def steps(model: torch.nn.Module, prompts: list[list[int]]) -> torch.Tensor:
    """Logits of a prefill of `prompts` and of two decode steps after it."""
    runner = PagedRunner(model, [len(p) + 2 for p in prompts])
    out = list(runner.step(dict(enumerate(prompts))))
    for token in (7, 9):
        out += runner.step({i: [token] for i in range(len(prompts))})
    return torch.cat(out)


@pytest.mark.parametrize("family", ["opt", "llama"])
def test_packed_half_matmuls_compute_what_f_linear_does(family: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models.opt, "PACK_MIN_WEIGHTS", 0)  # pack the tiny weights too
    plain, packed = build(family, seed=3), build(family, seed=3)
    packed.use_packed_half_matmuls()
    layers = [m for m in packed.modules() if isinstance(m, HalfLinear)]
    assert layers and all(m.is_packed for m in layers)
    assert isinstance(packed.lm_head, HalfLinear)  # the tied LM head, packed too
    assert sum(p.numel() for p in packed.parameters()) == sum(
        p.numel() for p in plain.parameters())  # the tied weight is not counted twice
    prompts = random_prompts([9, 31, 4], plain.config.vocab_size, seed=2)
    want, got = steps(plain, prompts), steps(packed, prompts)
    assert got.dtype == torch.bfloat16
    # the same GEMM; only the residual add, fused into it, rounds once instead of twice
    assert rel_err(got, want) < 2e-2
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


def test_native_half_gemm_gets_packed_half_matmuls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models.opt, "has_half_matmul", lambda dtype: True)
    model = build("llama", seed=1)
    assert not fit_matmuls_to(model, torch.device("cpu"))  # not switched to float32
    assert isinstance(model.model.layers[0].down_proj, HalfLinear)
    assert next(model.parameters()).dtype == torch.bfloat16


def test_silu_mul_fuses_the_gated_mlp_front(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models.opt, "PACK_MIN_WEIGHTS", 0)
    g = torch.Generator().manual_seed(5)
    fc = torch.nn.Linear(64, 2 * 96, dtype=torch.bfloat16)  # gate rows, then up rows; a bias
    with torch.no_grad():
        fc.weight.copy_(torch.randn(fc.weight.shape, generator=g) * 0.1)
        fc.bias.copy_(torch.randn(fc.bias.shape, generator=g))
    x = torch.randn(7, 64, generator=g).to(torch.bfloat16)
    gate, up = fc(x).float().chunk(2, dim=-1)
    got = models.opt.silu_mul(HalfLinear.of(fc), x)
    assert got.shape == (7, 96) and got.dtype == torch.bfloat16
    assert rel_err(got, torch.nn.functional.silu(gate) * up) < 2e-2


@pytest.mark.parametrize("split", [False, True])
def test_prompt_sized_products_match_in_row_blocks_or_whole(
        split: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt of 1,100 tokens through a packed layer (plain, ReLU, residual add, and the
    gated MLP's front), its products run whole or in `row_blocks.ROW_BLOCK` blocks."""
    from models import row_blocks
    monkeypatch.setattr(row_blocks, "_plans", {})
    monkeypatch.setattr(row_blocks, "_measure", lambda product, rows: (
        split, row_blocks._in_blocks(product, rows) if split else product(*rows)))
    monkeypatch.setattr(models.opt, "PACK_MIN_WEIGHTS", 0)
    g = torch.Generator().manual_seed(6)
    fc = torch.nn.Linear(64, 2 * 96, dtype=torch.bfloat16)
    with torch.no_grad():
        fc.weight.copy_(torch.randn(fc.weight.shape, generator=g) * 0.1)
    x = torch.randn(1100, 64, generator=g).to(torch.bfloat16)
    residual = torch.randn(1100, 2 * 96, generator=g).to(torch.bfloat16)
    layer, want = HalfLinear.of(fc), fc(x).float()
    for _ in range(2):  # measured, then planned
        assert rel_err(layer(x), want) < 2e-2
        assert rel_err(layer(x, relu=True), want.relu()) < 2e-2
        assert rel_err(layer(x, residual=residual), want + residual.float()) < 2e-2
        gate, up = want.chunk(2, dim=-1)
        assert rel_err(layer.silu_mul(x), torch.nn.functional.silu(gate) * up) < 2e-2
    assert set(row_blocks.plans().values()) == {split} and len(row_blocks.plans()) == 4


@pytest.mark.parametrize("layout", [models.opt.PACK_BATCH, models.opt.PROMPT_PACK_BATCH])
def test_either_packed_layout_computes_what_f_linear_does(layout: int,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Whichever layout `half_layout` picks, a product of decode and of prompt rows (the
    residual add and the fused SiLU product included) is `F.linear`'s."""
    monkeypatch.setattr(models.opt, "half_layout", lambda weight: layout)
    torch.manual_seed(0)
    fc = torch.nn.Linear(256, 1024, dtype=torch.bfloat16)
    layer = HalfLinear.of(fc)
    for rows in (3, 64, 300):
        x = torch.randn(rows, 256, dtype=torch.bfloat16)
        residual = torch.randn(rows, 1024, dtype=torch.bfloat16)
        want = torch.nn.functional.linear(x.float(), fc.weight.float(), fc.bias.float())
        assert rel_err(layer(x), want) < 1e-2
        assert rel_err(layer(x, residual=residual), want + residual.float()) < 1e-2
        gate, up = want.chunk(2, dim=-1)
        assert rel_err(models.opt.silu_mul(layer, x), torch.nn.functional.silu(gate) * up) < 2e-2


def test_the_layout_is_timed_once_per_shape_and_lm_heads_keep_the_decode_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    timings: list[object] = []
    best_seconds = models.opt.measure.best_seconds
    monkeypatch.setattr(models.opt.measure, "best_seconds",
                        lambda ways, trials: timings.append(ways) or best_seconds(ways, trials))
    monkeypatch.setattr(models.opt, "_half_layouts", {})
    weight = torch.randn(512, 384, dtype=torch.bfloat16)
    first = models.opt.half_layout(weight)
    assert first in (models.opt.PACK_BATCH, models.opt.PROMPT_PACK_BATCH)
    assert len(timings) == len(models.opt.LAYOUT_ROWS)
    assert models.opt.half_layout(weight.clone()) == first  # same shape: no new timing
    assert len(timings) == len(models.opt.LAYOUT_ROWS)
    model = build("llama", 0)
    monkeypatch.setattr(models.opt, "PACK_MIN_WEIGHTS", 0)
    monkeypatch.setattr(models.opt, "has_half_matmul", lambda dtype: True)  # any oneDNN bf16
    fit_matmuls_to(model, torch.device("cpu"))
    assert isinstance(model.lm_head, HalfLinear) and not model.lm_head.for_prompts
    assert all(m.for_prompts for m in model.modules() if isinstance(m, HalfLinear))


def test_timing_a_layout_leaves_the_global_random_state_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded runs sample the same tokens whether or not their first forward timed a
    layout."""
    monkeypatch.setattr(models.opt, "_half_layouts", {})
    torch.manual_seed(5)
    want = torch.rand(4)
    torch.manual_seed(5)
    models.opt.half_layout(torch.randn(256, 128, generator=torch.Generator().manual_seed(1)
                                       ).to(torch.bfloat16))
    assert torch.equal(torch.rand(4), want)
