"""sim.search: each system at its best prefill:decode split, continuous on every device,
bounded runs (a run that stops making progress is reported, not waited for), and the share
of decode time lost to the per-seq kernel's imbalance."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.workloads import synthetic
from sim import CostModel, cluster_for, get_geometry, get_hardware
from sim.cli import main
from sim.search import MeteredCost, best_split, run_bounded, splits_of

GEOMETRY, HARDWARE = get_geometry("opt-1.3b"), get_hardware("a100")
WORKLOAD = synthetic(30, short_ratio=0.8, rate=50.0, seed=3)


def _config_for(num_prefill: int, num_decode: int):  # type: ignore[no-untyped-def]
    return cluster_for(HARDWARE, GEOMETRY, num_prefill, num_decode, min_requests=8)


def _cost(kernel: str = "per-seq") -> CostModel:
    return CostModel(GEOMETRY, HARDWARE, kernel=kernel)  # type: ignore[arg-type]


def test_splits_of_every_device_count() -> None:
    assert splits_of(4) == [(1, 3), (2, 2), (3, 1)]
    with pytest.raises(ValueError, match="num_devices"):
        splits_of(1)


def test_best_split_is_the_fastest_finished_split() -> None:
    placement = best_split(WORKLOAD, "fcfs", splits_of(4), _config_for, _cost())
    assert set(placement.tried) == {(1, 3), (2, 2), (3, 1)}
    assert placement.finished and placement.split in placement.tried
    assert placement.tried[placement.split] == max(placement.tried.values())
    assert placement.label == f"fcfs @{placement.split[0]}+{placement.split[1]}"
    for split, throughput in placement.tried.items():  # each figure is that split's own run
        result, _ = run_bounded(WORKLOAD, "fcfs", _config_for(*split), _cost())
        assert result.summary(tpot_target=math.inf).decode_throughput == throughput


def test_continuous_runs_once_on_every_device() -> None:
    placement = best_split(WORKLOAD, "continuous", splits_of(4), _config_for, _cost())
    assert placement.split == (0, 4) and list(placement.tried) == [(0, 4)]
    assert len(placement.result.device_busy) == 4  # one colocated instance per device
    assert placement.label == "continuous @all 4"


def test_a_run_cut_off_is_reported_not_waited_for() -> None:
    placement = best_split(WORKLOAD, "aligned", [(1, 1)], _config_for, _cost(), max_events=50)
    assert not placement.finished and math.isnan(placement.tried[(1, 1)])
    assert placement.result.num_loop_events == 50
    assert placement.label.endswith("(CUT OFF)")
    short, _ = run_bounded(WORKLOAD, "fcfs", _config_for(1, 1), _cost(), horizon=0.01)
    assert short.end_time <= max(r.arrival_time for r in WORKLOAD.requests) + 0.01
    assert short.num_finished < short.num_requests


def test_imbalance_share_is_zero_for_split_k_and_matches_the_model_for_per_seq() -> None:
    _, split_share = run_bounded(WORKLOAD, "fcfs", _config_for(1, 1), _cost("split-k"))
    assert split_share == 0.0
    metered = MeteredCost(_cost("per-seq"))
    lengths = [30, 900, 60, 2000]
    total = metered.iteration_time(lengths)
    flat = CostModel(GEOMETRY, HARDWARE, kernel="split-k").iteration_time(lengths)
    assert metered.imbalance_share == pytest.approx((total - flat) / total)
    metered.iteration_time([], [(0, 100)])  # a prefill step is not a decode step
    assert metered.decode_time == pytest.approx(total)


def test_unknown_system_is_rejected() -> None:
    with pytest.raises(ValueError, match="'nope'"):
        best_split(WORKLOAD, "nope", splits_of(2), _config_for, _cost())


def test_cli_split_best_labels_every_row_with_its_split(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim.json"
    code = main(["--workload", "synthetic", "--num-requests", "40", "--rate", "50", "--model",
                 "opt-1.3b", "--hardware", "a100", "--split", "best", "--gpus", "3",
                 "--systems", "fcfs,continuous", "--kernel", "per-seq", "--tpot-slo", "0.05",
                 "--json", str(out)])
    assert code == 0
    doc = json.loads(out.read_text())
    systems = [r["system"] for r in doc["results"]]
    assert systems[0].startswith("fcfs @") and systems[1] == "continuous @all 3"
    assert all(r["tpot_slo"] == 0.05 for r in doc["results"])
    placements = doc["config"]["placements"]
    assert set(placements[systems[0]]["tried"]) == {"1+2", "2+1"}
    assert "goodput req/s (TPOT ≤ 50 ms)" in capsys.readouterr().out
