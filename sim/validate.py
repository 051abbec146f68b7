"""Validation: calibrate on one engine run's iteration records, simulate the engine's
configuration on another workload, and print predicted against measured figures.

The measured side is the benchmark's JSON result rows (`bench.report.write_json`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from bench.workloads import Workload
from models.backends import ATTENTION_KERNELS
from scheduler.calibrate import DTYPE_BYTES, Calibration, Record, fit
from scheduler.cost_model import CostModel, get_geometry, kernel_kind
from scheduler.hardware import get_hardware
from sim.cluster import ClusterConfig
from sim.run import simulate

METRICS = ("decode_throughput", "tpot_p99", "tpot_mean", "ttft_mean")
TOLERANCE = 0.15  # predictions count as valid within this share of the engine's figure
BENCH_BATCH_REQUESTS = 32  # `aserve bench --batch-requests` default (BenchSettings)
_CLUSTER_KEYS = ("block_size", "num_decode_blocks", "num_prefill_blocks", "num_staging_blocks",
                 "max_prefill_tokens", "max_batch_size", "min_requests", "leaf_width",
                 "batch_kv_fraction", "starvation_threshold")


@dataclass(frozen=True, slots=True)
class ValidationRow:
    """One system's one metric, predicted and measured."""

    system: str
    metric: str
    predicted: float
    measured: float

    @property
    def rel_error(self) -> float:
        """(predicted - measured) / measured; NaN without a measurement."""
        if not self.measured or math.isnan(self.measured):
            return math.nan
        return (self.predicted - self.measured) / self.measured


def cluster_from_header(header: Mapping[str, object]) -> ClusterConfig:
    """The engine's devices and capacities from a record header's EngineConfig-like keys
    (`host_pool_gb` is converted with the header's model and dtype)."""
    fields: dict[str, object] = {k: header[k] for k in _CLUSTER_KEYS if k in header}
    if "share_kv_memory" in header:  # how the run moved KV (not a size: see cluster_for_bench)
        fields["share_kv_memory"] = bool(header["share_kv_memory"])
    for key in ("prefill_devices", "decode_devices"):
        value = header.get(key)
        if isinstance(value, str):
            fields[key] = (value,)
        elif isinstance(value, (list, tuple)):
            fields[key] = tuple(str(v) for v in value)
    pool_gb = header.get("host_pool_gb")
    if isinstance(pool_gb, (int, float)):
        geometry = get_geometry(str(header.get("model", "opt-125m")))
        dtype_bytes = DTYPE_BYTES.get(str(header.get("dtype", "float32")), 4)
        block_bytes = int(fields.get("block_size", 16)) * geometry.kv_bytes_per_token(  # type: ignore[call-overload]
            dtype_bytes)
        fields["num_host_blocks"] = max(1, int(pool_gb * 2**30 // block_bytes))
    return ClusterConfig.create(**fields)


def policy_of(system: str) -> str:
    """The policy of a benchmark system name ("aligned/paged" -> "aligned")."""
    return system.split("/", 1)[0]


def cluster_for_bench(header: Mapping[str, object], workload: Workload,
                      batch_requests: int = BENCH_BATCH_REQUESTS) -> ClusterConfig:
    """The cluster `aserve bench` builds for `workload`: the header's sizes when it has
    them, else the harness's own sizing rule (`bench.harness.size_engine`) applied to the
    workload, the header's model and dtype (the iteration logs do not carry the sizing)."""
    if any(k in header for k in _CLUSTER_KEYS):
        return cluster_from_header(header)
    from bench.harness import model_config, size_engine  # torch: imported only when needed

    model, dtype = str(header.get("model", "opt-125m")), str(header.get("dtype", "bfloat16"))
    sizing = size_engine(workload, model_config(model), dtype, batch_requests)
    return cluster_from_header({**header, **sizing.options()})


def calibration_from_header(header: Mapping[str, object],
                            records: Sequence[Record]) -> Calibration:
    """Fits the cost model named by the header (model, dtype, attention, hardware)."""
    kernel = kernel_kind(ATTENTION_KERNELS.get(str(header.get("attention", "paged")), "split-k"))
    return fit(records, model=str(header.get("model", "opt-125m")),
               hardware=str(header.get("hardware", "cpu")), kernel=kernel,
               dtype_bytes=DTYPE_BYTES.get(str(header.get("dtype", "float32"))))


def validate(header: Mapping[str, object], records: Sequence[Record],
             measured: Sequence[Mapping[str, object]], workload: Workload,
             config: ClusterConfig | None = None) -> list[ValidationRow]:
    """Predicts every measured system on `workload` and prints a markdown table.

    Args:
        header, records: the calibration run (see `scheduler.calibrate.load_records`).
        measured: result rows of the run to predict ("system" plus Summary fields).
        workload: the workload that run replayed (same requests, same arrivals).
        config: the engine's cluster; by default read from the header.
    """
    calibration = calibration_from_header(header, records)
    hw = replace(get_hardware(calibration.hardware), dtype_bytes=calibration.dtype_bytes)
    cost = CostModel(get_geometry(calibration.model), hw, calibration.params,
                     calibration.kernel)
    config = config or cluster_for_bench(header, workload)
    rows: list[ValidationRow] = []
    for row in measured:
        system = str(row["system"])
        summary = simulate(workload, policy_of(system), config, cost).summary()
        for metric in METRICS:
            value = row.get(metric)
            rows.append(ValidationRow(system, metric, float(getattr(summary, metric)),
                                      float(value) if isinstance(value, (int, float))
                                      else math.nan))
    print(format_rows(rows, calibration))
    return rows


def format_rows(rows: Sequence[ValidationRow], calibration: Calibration) -> str:
    """A markdown table of predicted vs measured, with the calibration it used."""
    lines = [f"calibration: {calibration.model} on {calibration.hardware} "
             f"({calibration.kernel}), {calibration.num_records} records, median forward-time "
             f"error {calibration.median_rel_error:.1%}",
             "", "| system | metric | predicted | measured | error | within 15 % |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        err = r.rel_error
        ok = "–" if math.isnan(err) else ("yes" if abs(err) <= TOLERANCE else "no")
        err_text = "–" if math.isnan(err) else f"{err:+.1%}"
        lines.append(f"| {r.system} | {r.metric} | {r.predicted:.4g} | {r.measured:.4g} | "
                     f"{err_text} | {ok} |")
    return "\n".join(lines) + "\n"
