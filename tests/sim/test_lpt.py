"""The per-seq kernel's wave model, longest-first (LPT) order, and the paper's motivation
experiment (Llama-7B-like geometry, one H100) held against the model.

Relations are pinned, not floats: the constants are uncalibrated priors.
"""

from __future__ import annotations

import random
import statistics

import pytest

from scheduler.cost_model import wave_tokens
from sim import CostModel, get_geometry, get_hardware


def _model(kernel: str, model: str = "opt-13b") -> CostModel:
    return CostModel(get_geometry(model), get_hardware("h100"), kernel=kernel)  # type: ignore[arg-type]


def test_wave_model_by_hand() -> None:
    # heads 1, 2 slots: batch order waves (1, 10), (1, 10) = 20; longest first (10, 10), (1, 1).
    assert wave_tokens([1, 10, 1, 10], heads=1, slots=2) == 20
    assert wave_tokens([10, 10, 1, 1], heads=1, slots=2) == 11
    # heads 2, 3 slots: tasks s0h0 s0h1 s1h0 | s1h1 s2h0 s2h1 -> max(5, 7) + max(7, 3) = 14.
    assert wave_tokens([5, 7, 3], heads=2, slots=3) == 14


def test_longest_first_is_the_per_seq_model_on_sorted_lengths() -> None:
    lengths = [300, 4000, 50, 2000, 90, 3000]
    lpt, per_seq = _model("per-seq-lpt"), _model("per-seq")
    assert lpt.iteration_time(lengths) == per_seq.iteration_time(sorted(lengths, reverse=True))
    shuffled = list(lengths)
    random.Random(1).shuffle(shuffled)
    assert lpt.iteration_time(shuffled) == lpt.iteration_time(lengths)  # order-free


def test_issue_figure_256_uniform_lengths() -> None:
    """256 lengths uniform in 39-4,096 (seed 0): batch order about 1.5x longest-first, which
    comes within 2 % of split-K (measured: 279.8 / 184.2 / 182.2 ms)."""
    rng = random.Random(0)
    lengths = [rng.randint(39, 4096) for _ in range(256)]
    arrival, lpt, split = (_model(k).iteration_time(lengths)
                           for k in ("per-seq", "per-seq-lpt", "split-k"))
    assert 1.4 < arrival / lpt < 1.6
    assert 1.0 < lpt / split < 1.02


def _mean_iteration(model: CostModel, prompts: list[int], generated: int = 600,
                    every: int = 20) -> float:
    return statistics.mean(model.iteration_time([p + t for p in prompts])
                           for t in range(0, generated, every))


def test_motivation_64_short_vs_60_short_4_long() -> None:
    """Paper: 13.49 vs 21.73 ms per iteration (+61 %) on a Llama-7B-like model, batch 64,
    600 generated tokens. The per-seq wave model in batch order (long ones last) predicts
    +40..+80 %; longest-first and split-K remove about half of that increase."""
    short, mixed = [32] * 64, [32] * 60 + [4096] * 4
    per_seq = _model("per-seq", "opt-6.7b")
    base = _mean_iteration(per_seq, short)
    increase = _mean_iteration(per_seq, mixed) / base - 1
    assert 0.4 < increase < 0.8
    assert 10e-3 < base < 17e-3  # the paper's 13.49 ms within the priors' reach
    for kernel in ("per-seq-lpt", "split-k"):
        other = _model(kernel, "opt-6.7b")
        assert _mean_iteration(other, mixed) / _mean_iteration(other, short) - 1 < increase / 1.5


def test_motivation_length_groups_aligned_vs_mixed() -> None:
    """Paper: 64 length groups (10..3,790 tokens), aligned batches ~200 ms vs mixed ~233 ms
    TPOT (+17 %). In the wave model the answer depends on the mixed batches' order alone:
    ascending lengths cost a few %, a shuffled batch tens of %, longest-first almost nothing."""
    groups = [10 + 60 * i for i in range(64)]
    per_seq = _model("per-seq", "opt-6.7b")
    aligned = statistics.mean(_mean_iteration(per_seq, [g] * 64, every=100) for g in groups)
    ascending = _mean_iteration(per_seq, groups, every=100) / aligned - 1
    shuffled_groups = list(groups)
    random.Random(0).shuffle(shuffled_groups)
    shuffled = _mean_iteration(per_seq, shuffled_groups, every=100) / aligned - 1
    lpt = _mean_iteration(_model("per-seq-lpt", "opt-6.7b"), shuffled_groups, every=100)
    assert 0.0 < ascending < 0.17 < shuffled
    assert lpt / aligned - 1 < 0.05


@pytest.mark.parametrize("kernel", ["per-seq", "per-seq-lpt"])
def test_per_seq_kernels_never_beat_split_k(kernel: str) -> None:
    rng = random.Random(2)
    for _ in range(20):
        lengths = [rng.randint(1, 4096) for _ in range(rng.randint(1, 300))]
        assert _model(kernel).iteration_time(lengths) >= _model("split-k").iteration_time(lengths)


def _waves_one_by_one(lengths: list[int], heads: int, slots: int) -> int:
    """The wave model as its docstring states it, wave by wave."""
    tasks = [lengths[i // heads] for i in range(len(lengths) * heads)]
    return sum(max(tasks[first:first + slots]) for first in range(0, len(tasks), slots))


def test_vectorised_wave_model_matches_it_wave_by_wave() -> None:
    rng = random.Random(0)
    for _ in range(2000):  # waves over one seq's heads, over many seqs, and partial waves
        heads, slots = rng.randint(1, 48), rng.randint(1, 140)
        lengths = [rng.randint(1, 4096) for _ in range(rng.randint(1, 40))]
        assert wave_tokens(lengths, heads, slots) == _waves_one_by_one(lengths, heads, slots)
    assert wave_tokens([], heads=40, slots=132) == 0
