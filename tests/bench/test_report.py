"""Tests for bench/report.py: JSON shape, markdown ratios and the figure helpers."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from matplotlib.figure import Figure

from aserve.engine.sequence import Event, IterationRecord
from bench import report
from bench.metrics import Summary, request_metrics, summarize

CAPTION = report.Caption(machine="2-core CPU", model="opt-tiny", scale="10 requests")


def _summary(system: str, decode_throughput: float, tpot_p99: float) -> Summary:
    events = [Event("a", "arrival", 0.0), Event("a", "first_token", 0.5),
              Event("a", "token", 0.7), Event("a", "finish", 1.0)]
    base = summarize(system, events, [])
    return dataclasses.replace(base, decode_throughput=decode_throughput, tpot_p99=tpot_p99)


def _reject_constant(name: str) -> None:
    raise AssertionError(f"non-standard JSON constant {name}")


def test_write_json_shape(tmp_path: Path) -> None:
    path = tmp_path / "out.json"
    summaries = [_summary("aligned", 200.0, 0.01), _summary("fcfs", 100.0, 0.05)]
    report.write_json(path, {"workload": "azure-code", "seed": 0, "path": tmp_path}, summaries)
    doc = json.loads(path.read_text(), parse_constant=_reject_constant)
    assert set(doc) == {"config", "results"}
    assert doc["config"] == {"workload": "azure-code", "seed": 0, "path": str(tmp_path)}
    assert [r["system"] for r in doc["results"]] == ["aligned", "fcfs"]
    row = doc["results"][0]
    assert row["decode_throughput"] == 200.0 and row["ttft_mean"] == pytest.approx(0.5)
    assert set(row) == {f.name for f in dataclasses.fields(Summary)}


def test_write_json_turns_nan_into_null(tmp_path: Path) -> None:
    path = tmp_path / "out.json"
    report.write_json(path, {}, [summarize("empty", [], [])])
    row = json.loads(path.read_text(), parse_constant=_reject_constant)["results"][0]
    assert row["ttft_p99"] is None and row["num_requests"] == 0


def test_markdown_table_ratios_against_baseline() -> None:
    table = report.markdown_table(
        [_summary("aligned", 198.0, 0.01), _summary("vllm", 100.0, 0.074)], baseline="vllm"
    )
    lines = table.strip().splitlines()
    assert len(lines) == 4  # header, rule, two rows
    assert "decode tok/s vs vllm" in lines[0] and "TPOT p99 vs vllm" in lines[0]
    aligned = [c.strip() for c in lines[2].strip("|").split("|")]
    assert aligned[0] == "aligned" and aligned[-2:] == ["1.98×", "0.14×"]
    assert lines[3].strip("| ").endswith("1.00× | 1.00×")


def test_markdown_table_without_baseline_has_no_ratio_columns() -> None:
    table = report.markdown_table([_summary("aligned", 1.0, 0.01)])
    assert " vs " not in table
    assert table.splitlines()[0].count("|") == table.splitlines()[2].count("|")


def test_markdown_table_shows_missing_values_as_dash() -> None:
    row = report.markdown_table([summarize("empty", [], [])]).splitlines()[2]
    assert "nan" not in row and report.NO_VALUE in row


def test_markdown_table_unknown_baseline_is_rejected() -> None:
    with pytest.raises(ValueError, match="'peer'.*aligned"):
        report.markdown_table([_summary("aligned", 1.0, 0.01)], baseline="peer")


def _iterations() -> list[IterationRecord]:
    return [IterationRecord("decode0", 0.0, 4, 0, 10, 12, 0.01 * i, 0.001 * i, False, {})
            for i in range(1, 6)]


PLOTS: dict[str, Callable[[Path], Figure]] = {
    "fig7": lambda p: report.plot_throughput_by_short_share(
        p, [0.8, 0.9, 0.95], {"aligned": [3.0, 2.0, 1.0], "fcfs": [2.0, 1.5, 0.9]}, CAPTION),
    "fig8": lambda p: report.plot_workload_comparison(
        p, {"azure-code": [_summary("aligned", 2.0, 0.01), _summary("fcfs", 1.0, 0.02)],
            "sharegpt4": [_summary("aligned", 3.0, 0.01)]}, CAPTION),
    "fig11": lambda p: report.plot_schedule_time_cdf(p, {"aligned": _iterations()}, CAPTION),
    "fig12": lambda p: report.plot_forward_time_vs_long_length(
        p, [1000, 2000, 4000], {"padded": [0.01, 0.02, 0.04], "paged": [0.01, 0.01, 0.02]},
        CAPTION),
    "fig13": lambda p: report.plot_forward_time_cdf(p, {"aligned": _iterations()}, CAPTION),
    "fig14": lambda p: report.plot_ablation(
        p, {"aligned": 100.0, "no prefetch": 85.3, "neither": 71.5}, CAPTION, "aligned"),
    "fig15": lambda p: report.plot_ttft_cdf(
        p, {"aligned": request_metrics([Event("a", "arrival", 0.0),
                                        Event("a", "first_token", 0.4),
                                        Event("a", "finish", 0.4)])}, CAPTION),
}


@pytest.mark.parametrize("name", sorted(PLOTS))
def test_plot_writes_png_with_caption(name: str, tmp_path: Path) -> None:
    path = tmp_path / f"{name}.png"
    fig = PLOTS[name](path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert CAPTION.text in [t.get_text() for t in fig.texts]
    assert "opt-tiny" in CAPTION.text and "2-core CPU" in CAPTION.text


def test_ablation_bars_are_labelled_relative_to_baseline(tmp_path: Path) -> None:
    fig = PLOTS["fig14"](tmp_path / "fig14.png")
    labels = [t.get_text() for t in fig.axes[0].texts]
    assert labels == ["+0.0%", "-14.7%", "-28.5%"]


def test_ablation_unknown_baseline_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="baseline"):
        report.plot_ablation(tmp_path / "x.png", {"a": 1.0}, CAPTION, "b")


def test_tpot_cdf_marks_the_slo(tmp_path: Path) -> None:
    metrics = request_metrics([Event("a", "arrival", 0.0), Event("a", "first_token", 0.1),
                               Event("a", "token", 0.3), Event("a", "finish", 0.3)])
    fig = report.plot_tpot_cdf(tmp_path / "tpot.png", {"fcfs": metrics}, CAPTION, 0.1)
    step, slo = fig.axes[0].lines
    assert np.asarray(step.get_xdata()).tolist() == pytest.approx([200.0])  # ms
    assert np.asarray(slo.get_xdata()).tolist() == [100.0, 100.0]
    assert slo.get_label() == "SLO 100 ms"


def test_markdown_table_names_the_slo_and_shows_tpot_p50_and_iteration_latency() -> None:
    header = report.markdown_table([_summary("aligned", 1.0, 0.01)]).splitlines()[0]
    assert "goodput tok/s (TPOT ≤ 100 ms)" in header
    assert "TPOT p50 ms" in header and "iter p99 ms" in header


def test_cdf_steps_reach_one(tmp_path: Path) -> None:
    fig = report.plot_cdf(tmp_path / "cdf.png", {"s": [3.0, 1.0, 2.0, 4.0]}, "x", CAPTION)
    line = fig.axes[0].lines[0]
    assert np.asarray(line.get_xdata()).tolist() == [1.0, 2.0, 3.0, 4.0]
    assert np.asarray(line.get_ydata()).tolist() == [0.25, 0.5, 0.75, 1.0]
