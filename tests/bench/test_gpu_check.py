"""The GPU check's account of where an engine run's time went (bench/gpu_check.py)."""

from __future__ import annotations

import math

import pytest

from aserve.engine.sequence import Event, IterationRecord
from bench.gpu_check import path_row
from bench.harness import RunResult


def _step(instance: str, seconds: float) -> IterationRecord:
    return IterationRecord(instance, 0.0, 1, 0, 10, 10, seconds, 0.0, False, {})


def test_path_row_splits_a_run_into_busy_shares_and_per_request_waits() -> None:
    events = [Event(seq, kind, t) for seq, kind, t in [
        ("a", "arrival", 0.0), ("a", "prefill_start", 1.0), ("a", "prefill_end", 1.5),
        ("a", "decode_start", 4.5), ("a", "token", 4.6),
        ("b", "arrival", 0.0), ("b", "prefill_start", 3.0), ("b", "prefill_end", 3.5),
        ("b", "decode_start", 4.5),
        ("c", "arrival", 0.0), ("c", "prefill_start", 2.0), ("c", "prefill_end", 2.5),
        ("c", "decode_start", 5.5),
    ]]
    result = RunResult("aligned/triton", events, [_step("decode0", 1.0), _step("decode0", 1.5)],
                       {}, wall_time=10.0, prefill_iterations=[_step("prefill0", 2.0)])
    row = path_row(result)
    assert row["decode_busy"] == pytest.approx(0.25)
    assert row["prefill_busy"] == pytest.approx(0.2)
    assert row["queue_s"] == pytest.approx(2.0)  # medians of (1, 3, 2), (0.5, ...), (3, 1, 3)
    assert row["prefill_s"] == pytest.approx(0.5)
    assert row["handoff_s"] == pytest.approx(3.0)


def test_path_row_has_no_hand_off_without_a_pool() -> None:
    """Colocated continuous batching decodes where it prefilled: no decode_start event."""
    events = [Event("a", "arrival", 0.0), Event("a", "prefill_start", 0.5),
              Event("a", "prefill_end", 1.0)]
    row = path_row(RunResult("continuous/triton", events, [], {}, wall_time=2.0))
    assert math.isnan(row["handoff_s"]) and row["decode_busy"] == 0.0  # type: ignore[arg-type]
