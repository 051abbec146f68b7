"""Calibration: fit `CostParams` to the iteration records of a real engine run, and save or
load the result as JSON.

The fit is linear least squares (numpy, non-negative by an active set) for each bytes-per-
FLOP balance on a log grid, refined around the best one; rows are weighted by 1 / time so
the relative error is what is minimised.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from scheduler.cost_model import (
    KERNELS,
    CostModel,
    CostParams,
    Features,
    KernelKind,
    ModelGeometry,
    get_geometry,
)
from scheduler.hardware import get_hardware

Record = Mapping[str, object]  # IterationRecord fields (or a JSON line of them)
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
GRID_DECADES = 3.0  # the balance grid spans this many decades either side of nominal
GRID_POINTS = 121
REFINE_STEPS = 40


@dataclass(frozen=True, slots=True)
class Calibration:
    """Fitted constants and what they were fitted on."""

    params: CostParams
    model: str
    hardware: str
    kernel: KernelKind
    dtype_bytes: int
    num_records: int
    median_rel_error: float  # of forward_time over the records, under the fitted params


def load_records(path: str | Path) -> tuple[dict[str, object], list[dict[str, object]]]:
    """JSON lines: iteration records (objects with "forward_time"); any other object is
    header (model, dtype, attention, hardware...) and is merged into the returned header."""
    header: dict[str, object] = {}
    records: list[dict[str, object]] = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        item = json.loads(line)
        if not isinstance(item, dict):
            raise ValueError(f"{path}: every line must be a JSON object, got {line[:60]!r}")
        if "forward_time" in item:
            records.append(item)
        else:
            header.update(item.get("header", item))
    return header, records


def record_lengths(record: Record) -> tuple[list[int], list[tuple[int, int]]]:
    """(decode lengths, prefill chunks) of a record.

    The engine records each seq's prefix after the step ("lengths") and the tokens it
    computed ("new_tokens"): a seq that computed one token is a decode of that length, any
    other a chunk ``(prefix before, new tokens)``. (A one-token prompt chunk is then
    counted as a decode: one query over the same prefix, the same bytes and FLOPs.)
    Logs written before "new_tokens" carry a packed prefill's prompts as
    "prefill_lengths", one chunk each. Otherwise prefill tokens count as one chunk, and the
    decode lengths are "lengths" when given, else spread evenly from min_len to max_len.
    """
    lengths, new = record.get("lengths"), record.get("new_tokens")
    packed = record.get("prefill_lengths")
    if isinstance(packed, (list, tuple)) and packed:
        lengths = new = packed
    if isinstance(lengths, (list, tuple)) and isinstance(new, (list, tuple)) and new:
        steps = [(int(n), int(k)) for n, k in zip(lengths, new, strict=True)]
        return [n for n, k in steps if k == 1], [(n - k, k) for n, k in steps if k != 1]
    batch_size, num_prefill = _int(record, "batch_size"), _int(record, "num_prefill_tokens")
    chunks = [(0, num_prefill)] if num_prefill > 0 else []
    num_decode = max(0, batch_size - len(chunks))
    if isinstance(lengths, (list, tuple)) and lengths:
        return [int(x) for x in lengths][:num_decode], chunks
    lo, hi = _int(record, "min_len"), _int(record, "max_len")
    if num_decode <= 1:
        return [hi] * num_decode, chunks
    return [round(lo + (hi - lo) * i / (num_decode - 1)) for i in range(num_decode)], chunks


def fit(records: Sequence[Record], model: str | ModelGeometry = "opt-125m",
        hardware: str = "cpu", kernel: KernelKind = "split-k",
        dtype_bytes: int | None = None, imbalance_weight: float | None = None) -> Calibration:
    """Fits the constants of the cost model of (`model`, `hardware`, `kernel`) to `records`
    (`model`: a name of scheduler/cost_model.py's table, or the geometry itself).

    `imbalance_weight` holds the imbalance term's weight at the nominal bandwidth fixed
    (`CostParams.imbalance_weight`) and fits the rest: records whose lengths hardly differ
    cannot tell it from a per-seq cost (aserve/engine/step_probe.py).

    Raises:
        ValueError: with fewer than 3 usable records (forward_time > 0, batch_size >= 1,
            not fused).
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel ({kernel!r}) must be one of {KERNELS}")
    hw = get_hardware(hardware)
    hw = replace(hw, dtype_bytes=dtype_bytes) if dtype_bytes else hw
    geometry = get_geometry(model) if isinstance(model, str) else model
    nominal = CostModel(geometry, hw, _NOMINAL, kernel)
    # NOTE: a fused record's time is a forward over another instance's step as well
    rows = [r for r in records if _float(r, "forward_time") > 0 and _int(r, "batch_size") >= 1
            and not r.get("fused", False)]
    if len(rows) < 3:
        raise ValueError(f"records ({len(rows)} usable) must number >= 3 to fit 4 constants")
    feats = [nominal.features(*record_lengths(r)) for r in rows]
    times = np.array([_float(r, "forward_time") for r in rows])
    q0 = hw.memory_bandwidth / hw.matmul_rate  # bytes per FLOP at equal efficiencies
    grid = q0 * np.logspace(-GRID_DECADES, GRID_DECADES, GRID_POINTS)
    q = _best_balance(feats, times, hw.memory_bandwidth, grid, imbalance_weight)
    coef, _ = _solve(feats, times, q, hw.memory_bandwidth, imbalance_weight)
    has_imbalance = imbalance_weight is not None or any(f.imbalance_bytes > 0 for f in feats)
    has_prefill = any(f.prefill_flops > 0 for f in feats)
    params = _to_params(coef, q, hw.memory_bandwidth, hw.matmul_rate, has_imbalance,
                        has_prefill)
    fitted = CostModel(nominal.geometry, hw, params, kernel)
    rel = [abs(fitted.time_of(f) / t - 1) for f, t in zip(feats, times)]
    return Calibration(params, geometry.name, hw.name, kernel, hw.dtype_bytes, len(rows),
                       float(np.median(rel)))


def calibrate(records: Sequence[Record], model: str = "opt-125m", hardware: str = "cpu",
              kernel: KernelKind = "split-k", dtype_bytes: int | None = None) -> CostParams:
    """The fitted `CostParams` (see `fit`)."""
    return fit(records, model, hardware, kernel, dtype_bytes).params


def save_calibration(path: str | Path, calibration: Calibration) -> None:
    doc = {**asdict(calibration), "params": asdict(calibration.params)}
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")


def load_calibration(path: str | Path) -> Calibration:
    """Reads what `save_calibration` wrote. Raises ValueError on a malformed file."""
    doc = json.loads(Path(path).read_text())
    try:
        return Calibration(**{**doc, "params": CostParams(**doc["params"])})
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a calibration file ({exc})") from exc


_NOMINAL = CostParams(step_overhead=0.0, per_seq_overhead=0.0, bw_efficiency=1.0,
                      flops_efficiency=1.0, imbalance_scale=1.0)


def _design(feats: Sequence[Features], q: float, bw: float) -> np.ndarray:
    """Columns: per step, per seq, the roofline of everything but prompt tokens, imbalance,
    and the prompt tokens' attention and all their FLOPs (priced apart: `CostParams`)."""
    return np.array([[1.0, f.num_seqs, max(f.mem_bytes, q * (f.flops - f.prefill_flops)) / bw,
                      f.imbalance_bytes / bw, q * f.prefill_attention_flops / bw,
                      q * f.prefill_flops / bw] for f in feats])


def _solve(feats: Sequence[Features], times: np.ndarray, q: float, bw: float,
           imbalance: float | None = None) -> tuple[np.ndarray, float]:
    """Non-negative least squares on relative residuals; returns (coefficients, error).
    `imbalance`: the imbalance column's coefficient, held fixed (None: fitted)."""
    a = _design(feats, q, bw) / times[:, None]
    b = np.ones(len(times))
    active = [j for j in range(a.shape[1]) if np.any(a[:, j])]
    if imbalance is not None:
        b -= imbalance * a[:, 3]
        active = [j for j in active if j != 3]
    while True:
        coef = np.zeros(a.shape[1])
        if imbalance is not None:
            coef[3] = imbalance
        coef[active] = np.linalg.lstsq(a[:, active], b, rcond=None)[0]
        negative = [j for j in active if coef[j] < 0 and j != 2]  # keep the roofline term
        if coef[2] < 0 and 0 in active:
            # NOTE: a decode step's roofline is its weights' fixed bytes plus its KV, so a
            # per-step constant can stand in for the weights and leave the roofline
            # negative (the KV then priced by the imbalance column alone); the constant
            # goes, as a negative coefficient would
            negative = [0]
        if not negative:
            break
        active.remove(min(negative, key=lambda j: coef[j]))
    return coef, float(np.sum((a @ coef - 1) ** 2))


def _best_balance(feats: Sequence[Features], times: np.ndarray, bw: float,
                  grid: np.ndarray, imbalance: float | None = None) -> float:
    """The bytes-per-FLOP balance with the least error. When the records cannot tell a
    range of balances apart (e.g. every iteration memory-bound), the one closest to the
    default efficiencies' balance wins: the records say nothing against the prior."""
    errors = np.array([_solve(feats, times, q, bw, imbalance)[1] for q in grid])
    tied = np.flatnonzero(errors <= errors.min() * (1 + 1e-3) + 1e-12 * len(times))
    if len(tied) > 2:
        prior = CostParams()
        q_prior = grid[GRID_POINTS // 2] * prior.bw_efficiency / prior.flops_efficiency
        return float(min(grid[tied], key=lambda q: abs(math.log(q / q_prior))))
    best = int(tied[0])
    return _refine(feats, times, bw, grid[max(best - 1, 0)],
                   grid[min(best + 1, GRID_POINTS - 1)], imbalance)


def _refine(feats: Sequence[Features], times: np.ndarray, bw: float, lo: float,
            hi: float, imbalance: float | None = None) -> float:
    """Golden-section search for the best balance in [lo, hi] (log scale)."""
    a, b = math.log(lo), math.log(hi)
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(REFINE_STEPS):
        c, d = b - ratio * (b - a), a + ratio * (b - a)
        if (_solve(feats, times, math.exp(c), bw, imbalance)[1]
                <= _solve(feats, times, math.exp(d), bw, imbalance)[1]):
            b = d
        else:
            a = c
    return math.exp((a + b) / 2)


def _to_params(coef: np.ndarray, q: float, bw: float, rate: float, has_imbalance: bool,
               has_prefill: bool) -> CostParams:
    """max(m / (bw be), f / (rate fe)) = c2 max(m, q f) / bw with be = 1 / c2 and
    q = bw be / (rate fe); the imbalance term c3 imb / bw = scale imb / (bw be); the prompt
    tokens' (c5 q p + c4 q a) / bw = (p + slowdown a) / (rate pe), so pe = bw / (c5 q rate)
    and slowdown = c4 / c5. Records without imbalance (split-k) say nothing about its
    scale, nor records without prompt tokens about theirs: those keep their defaults."""
    c2 = max(float(coef[2]), 1e-9)
    bw_eff = 1.0 / c2
    c5 = max(float(coef[5]), 1e-12)
    return CostParams(step_overhead=max(float(coef[0]), 0.0),
                      per_seq_overhead=max(float(coef[1]), 0.0), bw_efficiency=bw_eff,
                      flops_efficiency=bw * bw_eff / (rate * q),
                      imbalance_scale=max(float(coef[3]), 0.0) / c2 if has_imbalance else 1.0,
                      prefill_flops_efficiency=bw / (c5 * q * rate) if has_prefill else None,
                      attention_slowdown=max(float(coef[4]), 0.0) / c5 if has_prefill else 0.0)


def _int(record: Record, key: str) -> int:
    value = record.get(key, 0)
    return int(value) if isinstance(value, (int, float)) else 0


def _float(record: Record, key: str) -> float:
    value = record.get(key, 0.0)
    return float(value) if isinstance(value, (int, float)) else 0.0
