"""Lifecycle traces stay bounded in a long-running engine, and metrics count each iteration
record exactly once across trims."""

from __future__ import annotations

from aserve.cores import Lifecycle
from aserve.engine.sequence import IterationRecord
from aserve.entrypoints.metrics import ServerMetrics


def record(i: int) -> IterationRecord:
    return IterationRecord("decode0", float(i), 1, 0, 10, 10, 0.001, 0.0, False, {})


def test_traces_are_trimmed_past_the_limit() -> None:
    outputs = Lifecycle(None, eos_token_id=2, trace_limit=10)
    for i in range(25):
        outputs.event(f"r{i}", "arrival", float(i))
        outputs.iteration(record(i))
    assert len(outputs.events) <= 10 and len(outputs.iterations) <= 10
    assert outputs.events[-1].seq_id == "r24"  # the newest are kept
    assert outputs.num_dropped_iterations + len(outputs.iterations) == 25


def test_metrics_observe_each_iteration_once_across_trims() -> None:
    outputs = Lifecycle(None, eos_token_id=2, trace_limit=10)
    metrics = ServerMetrics()
    stats = {"running": 0, "waiting": 0, "kv": {}}
    for i in range(37):
        outputs.iteration(record(i))
        if i % 3 == 0:
            metrics.update(stats, outputs.iterations, outputs.num_dropped_iterations)
    metrics.update(stats, outputs.iterations, outputs.num_dropped_iterations)
    text = metrics.render().decode()
    count = next(line for line in text.splitlines()
                 if line.startswith("aserve_iteration_forward_seconds_count"))
    assert float(count.split()[-1]) == 37


def test_an_engine_keeps_a_bounded_trace_unless_asked_for_all() -> None:
    from aserve.engine.config import EngineConfig

    assert EngineConfig().trace_limit is not None  # a long-running server stays bounded
    full = Lifecycle(None, eos_token_id=2, trace_limit=None)
    for i in range(25):
        full.iteration(record(i))
    assert len(full.iterations) == 25 and full.num_dropped_iterations == 0
