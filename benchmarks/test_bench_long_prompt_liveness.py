"""The long-prompt livelock, replayed (`pytest -m bench`, not CI): a long-prompt, summarization-like
workload (prompts median ~2.7k tokens, outputs median ~170, total <= 4,096), 2,000 requests,
OPT-13B on 6 prefill + 2 decode H100s, offline, per-seq kernel. Before MAX_RETURNS, `aligned`
never finished it: after ~1,170 simulated seconds every event was one decode instance's KV
copy landing (a seq returned to the pool, staged again, returned again).

Every registered policy must finish every request, in bounded simulated time, with every
request moved back to the pool at most a few times. Prints one row per policy.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter

import pytest

from bench.workloads import synthetic
from scheduler import POLICIES
from scheduler.hardware import get_hardware
from sim import CostModel, CostParams, get_geometry, simulate
from sim.cluster import cluster_for

pytestmark = pytest.mark.bench

NUM_REQUESTS = 2000
MAX_POOL_MOVES = 4  # returns to the pool per request (MAX_RETURNS is 2; evictions add a few)
MAX_EVENTS = 2_000_000  # a livelock is a reported failure, not a hang


def long_prompt_workload():
    # uniform 1,800-3,600 prompt tokens (median ~2.7k) and 64-276 output tokens (median ~170)
    return synthetic(NUM_REQUESTS, short_ratio=1.0, short_range=(1800, 3600),
                     long_range=(3600, 3800), output_range=(64, 276), seed=0)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_long_prompt_trace_finishes(policy: str) -> None:
    workload = long_prompt_workload()
    prompts = [r.prompt_len for r in workload.requests]
    outputs = [r.output_len for r in workload.requests]
    assert 2500 <= statistics.median(prompts) <= 2900 and 150 <= statistics.median(outputs) <= 190
    assert max(p + o for p, o in zip(prompts, outputs)) <= 4096
    hw, geometry = get_hardware("h100"), get_geometry("opt-13b")
    config = cluster_for(hw, geometry, 6, 2, min_requests=128, max_batch_size=256,
                         max_prefill_tokens=4096)
    start = time.perf_counter()
    result = simulate(workload, policy, config, CostModel(geometry, hw, CostParams(), "per-seq"),
                      max_events=MAX_EVENTS)
    wall = time.perf_counter() - start
    to_pool = Counter(t.seq_id for t in result.transfers
                      if t.dst == "host" and not t.src.startswith("prefill"))
    summary = result.summary()
    print(f"\n{policy}: finished {result.num_finished}/{result.num_requests} in "
          f"{result.end_time:.0f} simulated s, {result.num_loop_events} events, "
          f"{len(result.transfers) / NUM_REQUESTS:.2f} KV moves/request, most returns to the "
          f"pool {max(to_pool.values(), default=0)}, decode {summary.decode_throughput:.0f} "
          f"tok/s, P99 TPOT {summary.tpot_p99 * 1e3:.0f} ms (wall {wall:.0f} s)")
    assert result.num_loop_events < MAX_EVENTS, "cut off: the run kept going without finishing"
    assert result.num_finished == NUM_REQUESTS
    assert all(n == 0 for n in result.blocks_left.values())
    assert max(to_pool.values(), default=0) <= MAX_POOL_MOVES, to_pool.most_common(3)
