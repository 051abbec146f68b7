"""Calibration: constants recovered from records a known cost model produced, JSON files."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from scheduler.calibrate import (
    Calibration,
    calibrate,
    fit,
    load_calibration,
    load_records,
    record_lengths,
    save_calibration,
)
from scheduler.cost_model import CostModel, CostParams, KernelKind, get_geometry
from scheduler.hardware import get_hardware

TRUE = CostParams(step_overhead=3e-3, per_seq_overhead=2e-4, bw_efficiency=0.4,
                  flops_efficiency=0.3, imbalance_scale=0.7, prefill_flops_efficiency=0.5,
                  attention_slowdown=4.0)


def _records(kernel: KernelKind, n: int = 120, seed: int = 0,
             hardware: str = "cpu") -> list[dict[str, object]]:
    """Iteration records of opt-125m, timed by TRUE: decode steps (memory-bound) and, every
    third, a mixed step with a prefill chunk (compute-bound)."""
    model = CostModel(get_geometry("opt-125m"), get_hardware(hardware), TRUE, kernel)
    rng = random.Random(seed)
    out = []
    for i in range(n):
        lengths = [rng.randint(16, 600) for _ in range(rng.randint(1, 64))]
        num_prefill = rng.randint(64, 1024) if i % 3 == 0 else 0
        chunks = [(0, num_prefill)] if num_prefill else []
        out.append(dict(batch_size=len(lengths) + len(chunks), min_len=min(lengths),
                        max_len=max(lengths), num_prefill_tokens=num_prefill,
                        forward_time=model.iteration_time(lengths, chunks), lengths=lengths))
    return out


@pytest.mark.parametrize(("kernel", "hardware"), [("split-k", "cpu"), ("per-seq", "a100")])
def test_fit_recovers_the_constants_that_made_the_records(kernel: KernelKind,
                                                          hardware: str) -> None:
    """(per-seq on a 2-core CPU has no imbalance to fit: 12 heads fill both cores.)"""
    calibration = fit(_records(kernel, hardware=hardware), model="opt-125m",
                      hardware=hardware, kernel=kernel)
    got = calibration.params
    assert got.step_overhead == pytest.approx(TRUE.step_overhead, rel=0.05)
    assert got.per_seq_overhead == pytest.approx(TRUE.per_seq_overhead, rel=0.05)
    assert got.bw_efficiency == pytest.approx(TRUE.bw_efficiency, rel=0.05)
    # (flops_efficiency is not identified: no decode step here is compute-bound, and the
    # prompt tokens, which are, have their own rate.)
    if kernel == "per-seq":
        assert got.imbalance_scale == pytest.approx(TRUE.imbalance_scale, rel=0.05)
    assert got.prefill_flops_efficiency == pytest.approx(TRUE.prefill_flops_efficiency, rel=0.05)
    assert got.attention_slowdown == pytest.approx(TRUE.attention_slowdown, rel=0.05)
    assert calibration.median_rel_error < 0.01


def test_a_fixed_imbalance_weight_is_kept_and_the_rest_fitted() -> None:
    """Padded records hold a weight fixed; the others come out as the records say, and a
    wrong fixed weight costs fit error rather than moving the weight."""
    records = _records("padded")
    truth = TRUE.imbalance_weight
    right = fit(records, kernel="padded", imbalance_weight=truth)
    held = right.params
    assert right.median_rel_error < 1e-3
    assert held.imbalance_weight == pytest.approx(truth, rel=1e-9)
    assert held.per_seq_overhead == pytest.approx(TRUE.per_seq_overhead, rel=0.05)
    assert held.bw_efficiency == pytest.approx(TRUE.bw_efficiency, rel=0.05)
    wrong = fit(records, kernel="padded", imbalance_weight=truth / 3)
    assert wrong.params.imbalance_weight == pytest.approx(truth / 3, rel=1e-9)
    assert wrong.median_rel_error > 10 * right.median_rel_error


def test_fit_without_lengths_still_predicts_forward_time_closely() -> None:
    records = [{k: v for k, v in r.items() if k != "lengths"} for r in _records("split-k")
               if not r["num_prefill_tokens"]]
    params = calibrate(records, model="opt-125m", hardware="cpu", kernel="split-k")
    model = CostModel(get_geometry("opt-125m"), get_hardware("cpu"), params)
    lengths = [200] * 30 + [500] * 2
    truth = CostModel(get_geometry("opt-125m"), get_hardware("cpu"), TRUE)
    assert model.iteration_time(lengths) == pytest.approx(truth.iteration_time(lengths),
                                                          rel=0.1)


def test_record_lengths_spread_evenly_and_count_prefill_as_one_chunk() -> None:
    record = dict(batch_size=5, min_len=10, max_len=50, num_prefill_tokens=0)
    assert record_lengths(record) == ([10, 20, 30, 40, 50], [])
    mixed = dict(batch_size=3, min_len=10, max_len=30, num_prefill_tokens=100)
    assert record_lengths(mixed) == ([10, 30], [(0, 100)])
    packed = dict(batch_size=3, min_len=10, max_len=70, num_prefill_tokens=120,
                  prefill_lengths=[10, 40, 70])  # a packed prefill, as logs before new_tokens
    assert record_lengths(packed) == ([], [(0, 10), (0, 40), (0, 70)])


def test_record_lengths_read_each_seq_of_a_mixed_step() -> None:
    """A colocated step that prefills 12 prompts of 2,048 tokens in all is 12 chunks, not one
    2,048-token prompt and 11 made-up decodes (what min/max alone gave)."""
    prompts = [100, 300, 50, 200, 150, 250, 120, 180, 90, 210, 198, 200]
    record = dict(batch_size=14, min_len=50, max_len=827, num_prefill_tokens=2048,
                  lengths=[827, 400, *prompts], new_tokens=[1, 1, *prompts])
    assert record_lengths(record) == ([827, 400], [(0, n) for n in prompts])
    chunk = dict(batch_size=2, lengths=[700, 33], new_tokens=[200, 1])  # a chunk's second part
    assert record_lengths(chunk) == ([33], [(500, 200)])
    truth = CostModel(get_geometry("opt-125m"), get_hardware("cpu"), TRUE)
    spread = dict(record, lengths=None)
    assert truth.iteration_time(*record_lengths(spread)) > 1.1 * truth.iteration_time(
        [827, 400], [(0, n) for n in prompts])


def test_packed_prefill_records_fit_the_prefill_cost() -> None:
    """Decode records alone say little about prefill (compute-bound); a prefill instance's
    packed prefills, one chunk per prompt, pin it down."""
    truth = CostModel(get_geometry("opt-125m"), get_hardware("cpu"), TRUE)
    rng = random.Random(1)
    decode = [r for r in _records("split-k") if not r["num_prefill_tokens"]]
    packed = []
    for _ in range(20):
        prompts = [rng.randint(50, 900) for _ in range(rng.randint(1, 12))]
        packed.append(dict(batch_size=len(prompts), min_len=min(prompts),
                           max_len=max(prompts), num_prefill_tokens=sum(prompts),
                           forward_time=truth.prefill_time(prompts), prefill_lengths=prompts))
    model = CostModel(get_geometry("opt-125m"), get_hardware("cpu"),
                      calibrate(decode + packed, model="opt-125m", hardware="cpu"))
    prompts = [700, 300, 500, 900]
    assert model.prefill_time(prompts) == pytest.approx(truth.prefill_time(prompts), rel=0.02)


def test_too_few_records_are_refused() -> None:
    with pytest.raises(ValueError, match="records"):
        calibrate(_records("split-k", n=2))


def test_calibration_round_trips_through_json(tmp_path: Path) -> None:
    calibration = fit(_records("split-k", n=20))
    save_calibration(tmp_path / "cal.json", calibration)
    assert load_calibration(tmp_path / "cal.json") == calibration
    (tmp_path / "bad.json").write_text('{"params": {}}')
    with pytest.raises(ValueError, match="calibration"):
        load_calibration(tmp_path / "bad.json")


def test_records_file_keeps_header_and_records_apart(tmp_path: Path) -> None:
    lines = [{"header": {"model": "opt-125m", "dtype": "float32"}}, *_records("split-k", n=3)]
    path = tmp_path / "run.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    header, records = load_records(path)
    assert header == {"model": "opt-125m", "dtype": "float32"} and len(records) == 3
    assert isinstance(fit(records * 2), Calibration)


def test_padded_fit_predicts_the_steps_that_made_the_records() -> None:
    """Padded prices every row a step reads (batch x longest) apart from the roofline. A
    step's fixed cost and its weights' read are both per step, so the constants are not
    identified from decode steps; the predictions must be, large uniform steps included."""
    truth = CostModel(get_geometry("opt-125m"), get_hardware("cpu"), TRUE, "padded")
    params = fit(_records("padded"), model="opt-125m", kernel="padded").params
    fitted = CostModel(get_geometry("opt-125m"), get_hardware("cpu"), params, "padded")
    for lengths in ([2000] * 96, [64] * 8, [64] * 31 + [2000], [500] * 16, [300]):
        assert fitted.iteration_time(lengths) == pytest.approx(truth.iteration_time(lengths),
                                                               rel=0.02)


def test_the_engines_padded_steps_fit_over_the_familys_range() -> None:
    """benchmarks/data's padded steps of this engine (a scaled-down run and a grid of
    1-96 seqs of 65-2,001 tokens, `python -m bench.step_grid`): one fit holds over both.
    A fit that priced a seq's own rows at the weights' rate put large uniform steps at half
    their time, and one whose roofline went negative missed by a median 22 %."""
    from benchmarks.test_bench_family import PADDED_GRID, fitted_cost, padded_records

    model, error = fitted_cost(padded_records(), "padded")
    assert error < 0.08
    for r in load_records(PADDED_GRID)[1]:
        predicted = model.time_of(model.features(*record_lengths(r)))
        assert predicted / float(r["forward_time"]) == pytest.approx(1.0, abs=0.25), r
