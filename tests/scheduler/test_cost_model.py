"""The cost model: more KV is never cheaper, imbalance per kernel kind, geometry tables."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.cost_model import KERNELS, CostModel, CostParams, get_geometry
from scheduler.hardware import get_hardware

LENGTHS = st.lists(st.integers(1, 9000), min_size=1, max_size=300)


def _model(kernel: str, model: str = "opt-13b", hardware: str = "h100") -> CostModel:
    return CostModel(get_geometry(model), get_hardware(hardware), CostParams(), kernel)  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(lengths=LENGTHS, index=st.integers(0, 299), extra=st.integers(1, 5000),
       kernel=st.sampled_from(KERNELS))
def test_a_longer_sequence_is_never_cheaper(lengths: list[int], index: int, extra: int,
                                            kernel: str) -> None:
    model = _model(kernel)
    longer = list(lengths)
    longer[index % len(lengths)] += extra
    assert model.iteration_time(longer) >= model.iteration_time(lengths) * (1 - 1e-12)


@settings(max_examples=60, deadline=None)
@given(lengths=LENGTHS, new=st.integers(1, 9000), kernel=st.sampled_from(KERNELS))
def test_one_more_sequence_is_never_cheaper(lengths: list[int], new: int, kernel: str) -> None:
    model = _model(kernel)
    assert model.iteration_time([*lengths, new]) >= model.iteration_time(lengths) * (1 - 1e-12)


@settings(max_examples=40, deadline=None)
@given(lengths=LENGTHS)
def test_split_k_is_the_cheapest_kernel_for_any_batch(lengths: list[int]) -> None:
    split, per_seq, lpt, padded = (_model(k).iteration_time(lengths) for k in KERNELS)
    assert split <= per_seq and split <= padded * (1 + 1e-12)  # equal lengths: equal
    assert split <= lpt <= per_seq * (1 + 1e-12)  # sorted waves minimise the sum of maxima


def test_skew_costs_per_seq_but_not_split_k_at_equal_work() -> None:
    """docs/design.md §8: 60 x 632 + 4 x 4696 tokens against 64 x 947 (the same total KV)."""
    skewed = [632] * 60 + [4696] * 4
    uniform = [sum(skewed) // 64] * 64
    split, per_seq = _model("split-k"), _model("per-seq")
    assert split.iteration_time(skewed) == pytest.approx(split.iteration_time(uniform),
                                                         rel=1e-3)
    assert per_seq.iteration_time(skewed) > 1.05 * per_seq.iteration_time(uniform)


def test_decode_is_memory_bound_and_big_prefill_is_compute_bound() -> None:
    model = _model("split-k")
    overhead = 2e-3 + 1e-5  # CostParams defaults: per step + one seq
    weights_time = model.weight_bytes / (3.35e12 * 0.8)
    assert model.iteration_time([1]) == pytest.approx(weights_time + overhead, rel=0.01)
    flops = model.features((), [(0, 2048)]).flops
    assert model.prefill_time([2048]) == pytest.approx(flops / (989e12 * 0.6) + overhead,
                                                       rel=1e-6)
    assert model.prefill_time([2048]) > model.prefill_time([1024]) > model.prefill_time([16])


def test_prefill_attention_slowdown_prices_query_key_pairs_of_prompts_only() -> None:
    """A slowdown s makes each prefill attention FLOP cost (1 + s) matmul FLOPs; decodes, whose
    attention reads the KV (memory-bound), and the 0 default keep the roofline as it was."""
    hw = get_hardware("cpu")
    base = CostModel(get_geometry("opt-125m"), hw, CostParams())
    slow = CostModel(get_geometry("opt-125m"), hw, CostParams(attention_slowdown=3.0))
    pairs = 500 * 501 / 2 + 300 * 301 / 2  # causal query-key pairs of two whole prompts
    attention = 4.0 * 12 * 768 * pairs  # FLOPs: QK^T and PV, every layer
    assert slow.features((), [(0, 500), (0, 300)]).prefill_attention_flops == attention
    extra = slow.prefill_time([500, 300]) - base.prefill_time([500, 300])
    assert extra == pytest.approx(3.0 * attention / (hw.matmul_rate * 0.6), rel=1e-9)
    assert slow.iteration_time([900] * 16) == base.iteration_time([900] * 16)
    chunk = 4.0 * 12 * 768 * (100 * 400 + 100 * 101 / 2)  # 100 new tokens over 400 cached
    assert slow.features([50], [(400, 100)]).prefill_attention_flops == chunk


def test_geometry_parameter_counts_match_the_model_names() -> None:
    assert get_geometry("opt-13b").num_params / 1e9 == pytest.approx(12.85, rel=0.02)
    assert get_geometry("opt-125m").num_params / 1e6 == pytest.approx(125, rel=0.02)
    assert get_geometry("opt-30b").num_params / 1e9 == pytest.approx(30, rel=0.03)


def test_kv_bytes_count_whole_blocks() -> None:
    model = _model("split-k")
    assert model.kv_bytes_per_token == 2 * 40 * 5120 * 2
    assert model.kv_bytes(3, 16) == 3 * 16 * model.kv_bytes_per_token


@pytest.mark.parametrize("call", [lambda: get_geometry("gpt-2"), lambda: get_hardware("tpu"),
                                  lambda: _model("flash"), lambda: CostParams(bw_efficiency=0)])
def test_bad_names_and_values_raise_value_error(call: object) -> None:
    with pytest.raises(ValueError):
        call()  # type: ignore[operator]


def test_padded_prices_every_row_it_reads_and_loses_only_the_padding() -> None:
    """The padded kernel reads batch x longest rows, a seq's own as its padding, all at
    the kernel's rate and none inside the roofline: at an imbalance scale of 1 a step of
    equal lengths costs what split-K's does, and only split-K prices equal total KV the
    same spread or not. What it loses to imbalance (the bench tables' bubble share) is the
    padding rows alone: none for equal lengths."""
    params = CostParams(imbalance_scale=2.0)
    model = CostModel(get_geometry("opt-125m"), get_hardware("cpu"), params, "padded")
    kvb = model.kv_bytes_per_token
    assert model.imbalance_bytes([100, 300]) == 2 * 300 * kvb
    assert model.features([100, 300]).mem_bytes == model.weight_bytes
    assert model.lost_to_imbalance([200, 200]) == 0.0
    assert model.lost_to_imbalance([100, 300]) == pytest.approx(
        2.0 * 200 * kvb / model._bw, rel=1e-12)
    unit = CostParams(imbalance_scale=1.0)
    padded, split = (CostModel(get_geometry("opt-13b"), get_hardware("h100"), unit, k)
                     for k in ("padded", "split-k"))  # memory-bound decode steps
    for lengths in ([2000] * 8, [64] * 96, [300]):
        assert padded.iteration_time(lengths) == pytest.approx(split.iteration_time(lengths),
                                                               rel=1e-12)
    assert padded.iteration_time([100, 300]) > split.iteration_time([200, 200])
    assert _model("split-k").lost_to_imbalance([100, 300]) == 0.0
