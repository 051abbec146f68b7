"""Benchmark reports: JSON results, markdown tables with ratios, and the paper's figures.

Plots use matplotlib's Agg canvas directly (no pyplot state, no display); each carries a
caption line naming the machine, model and scale. Nothing in the package imports this.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from aserve.engine.sequence import IterationRecord
from bench.metrics import RequestMetrics, Summary

JsonValue = str | int | float | bool | None | list["JsonValue"] | dict[str, "JsonValue"]
MS = 1e3  # milliseconds per second
NO_VALUE = "–"  # shown in tables for NaN (no data)


@dataclasses.dataclass(frozen=True, slots=True)
class Caption:
    """Where a figure's numbers come from; printed under every plot."""

    machine: str  # e.g. "2-core CPU (AVX-512)" or "1x H200"
    model: str  # e.g. "opt-125m (random weights)"
    scale: str  # e.g. "length_scale=0.1, 200 requests"

    @property
    def text(self) -> str:
        return f"machine: {self.machine} | model: {self.model} | scale: {self.scale}"


def summary_row(summary: Summary) -> dict[str, JsonValue]:
    """A Summary as a JSON-ready dict; NaN (no data) becomes None."""
    return {k: json_safe(v) for k, v in dataclasses.asdict(summary).items()}


def write_json(
    path: str | Path, config: Mapping[str, object], summaries: Sequence[Summary]
) -> None:
    """Write `{"config": {...}, "results": [row, ...]}`; strict JSON (no NaN)."""
    doc = {
        "config": {k: json_safe(v) for k, v in config.items()},
        "results": [summary_row(s) for s in summaries],
    }
    Path(path).write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")


def markdown_table(summaries: Sequence[Summary], baseline: str | None = None) -> str:
    """A GitHub markdown table, one row per system.

    With a baseline, two ratio columns give system / baseline for decode throughput and for
    P99 TPOT (higher is better for the first, lower for the second). The goodput headers
    name the TPOT SLO of the first row.

    Raises:
        ValueError: if the baseline names no summarised system.
    """
    slo = _slo_label(summaries)
    header = ["system", "reqs", "decode tok/s", "req/s", f"goodput req/s ({slo})",
              f"goodput tok/s ({slo})", "TTFT mean s", "TTFT p99 s", "TPOT mean ms",
              "TPOT p50 ms", "TPOT p99 ms", "iter mean ms", "iter p50 ms", "iter p99 ms",
              "e2e p99 s", "mixed %", "aligned %"]
    base = _find(summaries, baseline) if baseline is not None else None
    if base is not None:
        header += [f"decode tok/s vs {base.system}", f"TPOT p99 vs {base.system}"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for s in summaries:
        cells = [s.system, str(s.num_requests), fmt(s.decode_throughput, 1),
                 fmt(s.request_throughput, 3), fmt(s.goodput, 3), fmt(s.goodput_tokens, 1),
                 fmt(s.ttft_mean, 3), fmt(s.ttft_p99, 3), fmt(s.tpot_mean * MS, 2),
                 fmt(s.tpot_p50 * MS, 2), fmt(s.tpot_p99 * MS, 2),
                 fmt(s.iteration_latency_mean * MS, 2), fmt(s.iteration_latency_p50 * MS, 2),
                 fmt(s.iteration_latency_p99 * MS, 2), fmt(s.e2e_p99, 3),
                 fmt(s.mixed_iteration_share * 100, 1),
                 fmt(s.aligned_iteration_share * 100, 1)]
        if base is not None:
            cells += [_ratio(s.decode_throughput, base.decode_throughput),
                      _ratio(s.tpot_p99, base.tpot_p99)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _slo_label(summaries: Sequence[Summary]) -> str:
    slo = summaries[0].tpot_slo if summaries else math.inf
    return "no SLO" if math.isinf(slo) else f"TPOT ≤ {slo * MS:g} ms"


def plot_throughput_by_short_share(
    path: str | Path, shares: Sequence[float], throughput: Mapping[str, Sequence[float]],
    caption: Caption,
) -> Figure:
    """Fig. 7: decode throughput (tok/s) per system against the share of short requests."""
    xs = [x * 100 for x in shares]
    return plot_lines(path, xs, throughput, "short requests (%)", "decode throughput (tok/s)",
                      caption)


def plot_workload_comparison(
    path: str | Path, results: Mapping[str, Sequence[Summary]], caption: Caption
) -> Figure:
    """Figs. 8-10: grouped bars of decode throughput and P99 TPOT, per workload and system."""
    fig = Figure(figsize=(10, 4))
    ax_thr, ax_tpot = fig.subplots(1, 2)
    workloads = list(results)
    systems = list(dict.fromkeys(s.system for rows in results.values() for s in rows))
    width = 0.8 / max(1, len(systems))
    for i, system in enumerate(systems):
        rows = [_find(results[w], system, missing_ok=True) for w in workloads]
        xs = [j + i * width for j in range(len(workloads))]
        ax_thr.bar(xs, [r.decode_throughput if r else 0.0 for r in rows], width, label=system)
        ax_tpot.bar(xs, [r.tpot_p99 * MS if r else 0.0 for r in rows], width, label=system)
    for ax, ylabel in ((ax_thr, "decode throughput (tok/s)"), (ax_tpot, "P99 TPOT (ms)")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(workloads))], workloads)
        ax.set_ylabel(ylabel)
    return _save(fig, path, caption, legend=True)


def plot_schedule_time_cdf(
    path: str | Path, iterations: Mapping[str, Sequence[IterationRecord]], caption: Caption
) -> Figure:
    """Fig. 11: CDF of the scheduling time per iteration boundary, per system (ms)."""
    series = {k: [it.schedule_time * MS for it in v] for k, v in iterations.items()}
    return plot_cdf(path, series, "scheduling time per iteration (ms)", caption)


def plot_forward_time_cdf(
    path: str | Path, iterations: Mapping[str, Sequence[IterationRecord]], caption: Caption
) -> Figure:
    """Fig. 13: CDF of the per-iteration latency (forward time of each decode iteration with
    at least one sequence), per system (ms)."""
    series = {k: [it.forward_time * MS for it in v if it.batch_size >= 1]
              for k, v in iterations.items()}
    return plot_cdf(path, series, "forward time per iteration (ms)", caption)


def plot_ttft_cdf(
    path: str | Path, metrics: Mapping[str, Sequence[RequestMetrics]], caption: Caption
) -> Figure:
    """Fig. 15: CDF of time to first token, per system (s)."""
    series = {k: [m.ttft for m in v if m.ttft is not None] for k, v in metrics.items()}
    return plot_cdf(path, series, "TTFT (s)", caption)


def plot_tpot_cdf(
    path: str | Path, metrics: Mapping[str, Sequence[RequestMetrics]], caption: Caption,
    tpot_slo: float | None = None,
) -> Figure:
    """CDF of per-request TPOT (ms) per system, with the SLO as a vertical line when given."""
    series = {k: [m.tpot * MS for m in v if m.tpot is not None] for k, v in metrics.items()}
    slo = tpot_slo * MS if tpot_slo is not None and math.isfinite(tpot_slo) else None
    return plot_cdf(path, series, "per-request TPOT (ms)", caption,
                    marks={f"SLO {slo:g} ms": slo} if slo is not None else None)


def plot_cdf(
    path: str | Path, series: Mapping[str, Sequence[float]], xlabel: str, caption: Caption,
    marks: Mapping[str, float] | None = None,
) -> Figure:
    """Empirical CDF (step plot) of each named series; `marks` adds labelled vertical lines."""
    fig, ax = _figure()
    for name, values in series.items():
        xs = sorted(values)
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", label=name)
    for label, x in (marks or {}).items():
        ax.axvline(x, color="0.4", linestyle="--", label=label)
    ax.set(xlabel=xlabel, ylabel="CDF", ylim=(0, 1.02))
    return _save(fig, path, caption, legend=True)


def plot_forward_time_vs_long_length(
    path: str | Path, long_lens: Sequence[int], forward_times: Mapping[str, Sequence[float]],
    caption: Caption,
) -> Figure:
    """Fig. 12: forward time (s, plotted in ms) of one iteration against the long length."""
    series = {name: [t * MS for t in times] for name, times in forward_times.items()}
    return plot_lines(path, long_lens, series, "long request length (tokens)",
                      "forward time (ms)", caption)


def plot_lines(
    path: str | Path, xs: Sequence[float], series: Mapping[str, Sequence[float]], xlabel: str,
    ylabel: str, caption: Caption,
) -> Figure:
    """One marked line per named series over the shared x values."""
    fig, ax = _figure()
    for name, ys in series.items():
        ax.plot(list(xs), list(ys), marker="o", label=name)
    ax.set(xlabel=xlabel, ylabel=ylabel)
    return _save(fig, path, caption, legend=True)


def plot_ablation(
    path: str | Path, throughput: Mapping[str, float], caption: Caption, baseline: str
) -> Figure:
    """Fig. 14: decode throughput per variant, each bar labelled with its change vs baseline.

    Raises:
        ValueError: if the baseline is not one of the variants.
    """
    if baseline not in throughput:
        raise ValueError(f"baseline ({baseline!r}) must be one of {sorted(throughput)}")
    fig, ax = _figure()
    names = list(throughput)
    bars = ax.bar(names, [throughput[n] for n in names])
    base = throughput[baseline]
    labels = [f"{(throughput[n] / base - 1) * 100:+.1f}%" if base else NO_VALUE for n in names]
    ax.bar_label(bars, labels)
    ax.margins(y=0.1)
    ax.set(ylabel="decode throughput (tok/s)")
    return _save(fig, path, caption, legend=False)


def _figure() -> tuple[Figure, Axes]:
    fig = Figure(figsize=(6, 4))
    return fig, fig.subplots()


def _save(fig: Figure, path: str | Path, caption: Caption, legend: bool) -> Figure:
    if legend:
        for ax in fig.axes:
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.text(0.01, 0.01, caption.text, fontsize=7, color="0.3")
    FigureCanvasAgg(fig).print_figure(str(path), dpi=120)
    return fig


def _find(summaries: Sequence[Summary], system: str, missing_ok: bool = False) -> Summary | None:
    for s in summaries:
        if s.system == system:
            return s
    if missing_ok:
        return None
    raise ValueError(f"baseline ({system!r}) must be one of {[s.system for s in summaries]}")


def fmt(value: float, digits: int) -> str:
    return NO_VALUE if math.isnan(value) else f"{value:.{digits}f}"


def _ratio(value: float, base: float) -> str:
    if math.isnan(value) or math.isnan(base) or base == 0:
        return NO_VALUE
    return f"{value / base:.2f}×"


def json_safe(value: object) -> JsonValue:
    if isinstance(value, float):
        return None if not math.isfinite(value) else value
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if value is None or isinstance(value, (str, int, bool)):
        return value
    return str(value)
