"""Starvation control in the engine, on the virtual clock: a long request that cannot share a
batch with the stream of short ones enters decode soon after its threshold, and without the
control only once the stream has drained. Deterministic (no wall clock), so it holds on a
machine of any speed; the wall-clock version with the real model is a benchmark
(benchmarks/test_bench_starvation.py)."""

from __future__ import annotations

import random

import pytest

from aserve.engine.config import SchedulerConfig
from bench.workloads import Workload, WorkloadRequest
from scheduler import PolicyConfig, get_policy
from sim import ClusterConfig
from sim.drivers import SimContext
from tests.cores.test_differential import cost_model, engine_config, run_on_virtual_clock

THRESHOLD = 0.3  # seconds since the long request's last progress


def stream_with_one_long(num_groups: int = 40) -> Workload:
    """Groups of 8 short requests every 40 ms, faster than decode drains them, and after the
    first batches formed one request of 600 prompt tokens (38 blocks: it cannot share the
    decode budget of 48 with a running batch)."""
    rng = random.Random(1)
    reqs = [WorkloadRequest(f"s{i}", rng.randint(20, 40), 24, 0.001 + (i // 8) * 0.04)
            for i in range(num_groups * 8)]
    reqs.insert(17, WorkloadRequest("long", 600, 8, reqs[16].arrival_time))
    return Workload("starvation", tuple(reqs))


def long_request_wait(policy: str, threshold: float | None) -> tuple[float, float]:
    """Virtual seconds the long request waits from the pool to its first decode step, and the
    time the last short request finishes."""
    # NOTE: `aligned` decides with a padded step cost here: under a total-work cost it
    # admits in arrival order (grouping cannot pay there), and nothing starves
    cost = cost_model("padded" if policy == "aligned" else "split-k")
    config = engine_config(policy, starvation_threshold=threshold)
    probe = SimContext(ClusterConfig.from_engine(config, 1), cost,
                       get_policy(policy, PolicyConfig.of(SchedulerConfig(), 4096)))
    engine = run_on_virtual_clock(config, cost, probe, stream_with_one_long(), aborts={})
    first = {}
    for e in engine.events:
        if e.seq_id == "long":
            first.setdefault(e.kind, e.time)
    last_short = max(e.time for e in engine.events
                     if e.kind == "finish" and e.seq_id.startswith("s"))
    return first["decode_start"] - first["pooled"], last_short


@pytest.mark.parametrize("policy", ["aligned", "aligned-loose"])
def test_starvation_control_bounds_a_long_requests_wait(policy: str) -> None:
    wait_on, _ = long_request_wait(policy, THRESHOLD)
    wait_off, shorts_done = long_request_wait(policy, None)
    assert wait_off > THRESHOLD
    assert wait_on < wait_off / 2, (wait_on, wait_off)
    print(f"{policy}: long request waits {wait_on:.2f} s with a {THRESHOLD} s threshold, "
          f"{wait_off:.2f} s without (shorts done at {shorts_done:.2f} s)")
