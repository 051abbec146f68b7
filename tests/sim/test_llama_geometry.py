"""The simulator's Llama-family geometries: parameter counts of the real models, KV bytes
from the KV heads, and the paper's motivation experiment on Llama-7B's shapes."""

from __future__ import annotations

import statistics

import pytest

from sim import CostModel, get_geometry, get_hardware


@pytest.mark.parametrize(("name", "billions"), [
    ("llama-7b", 6.74), ("llama-13b", 13.02), ("llama3-8b", 8.03), ("smollm2-135m", 0.1345)])
def test_parameter_counts_are_the_real_models(name: str, billions: float) -> None:
    assert get_geometry(name).num_params / 1e9 == pytest.approx(billions, rel=2e-3)


@pytest.mark.parametrize(("name", "kv_heads"), [("llama-7b", 32), ("llama3-8b", 8),
                                                ("smollm2-135m", 3)])
def test_kv_bytes_follow_the_kv_heads(name: str, kv_heads: int) -> None:
    g = get_geometry(name)
    assert g.kv_bytes_per_token(2) == 2 * g.num_layers * kv_heads * g.head_dim * 2


def test_llama_7b_motivation_short_vs_four_long() -> None:
    """Paper, Llama-7B: 13.49 vs 21.73 ms per iteration (+61 %), batch 64, 600 tokens; the
    per-seq wave model in batch order (long ones last) predicts +40..+80 %."""
    model = CostModel(get_geometry("llama-7b"), get_hardware("h100"), kernel="per-seq")

    def mean(prompts: list[int]) -> float:
        return statistics.mean(model.iteration_time([p + t for p in prompts])
                               for t in range(0, 600, 20))

    base = mean([32] * 64)
    assert 0.4 < mean([32] * 60 + [4096] * 4) / base - 1 < 0.8
    assert 10e-3 < base < 17e-3
