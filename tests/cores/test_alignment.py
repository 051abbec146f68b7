"""Prefix-aware batching in the engine driver: under `aligned-strict` decode iterations stay
within its 1.5x spread where FCFS mixes lengths. Run on the virtual clock with the cost
model's step times (tests/cores/test_differential.py), so the decisions do not depend on the
machine's speed or load; the same figures with the real model on the wall clock are a
benchmark (benchmarks/test_bench_alignment.py)."""

from __future__ import annotations

import random

import pytest

from aserve.engine.config import SchedulerConfig
from aserve.engine.sequence import IterationRecord
from bench.workloads import Workload, WorkloadRequest
from scheduler import PolicyConfig, get_policy
from sim import ClusterConfig
from sim.drivers import SimContext
from tests.conftest import make_config
from tests.cores.test_differential import cost_model, run_on_virtual_clock


def aligned_share(iterations: list[IterationRecord]) -> float:
    """Share of decode iterations whose longest prefix is at most 1.5x the shortest."""
    decode = [r for r in iterations if r.batch_size]
    return sum(r.max_len <= 1.5 * r.min_len for r in decode) / len(decode)


def short_long(n: int, seed: int = 0) -> Workload:
    """95 % short prompts (100-300 tokens), 5 % long ones (1000-1400), 64 output tokens,
    all arriving at once."""
    rng = random.Random(seed)
    return Workload("short-long", tuple(
        WorkloadRequest(f"r{i}", rng.randint(1000, 1400) if i % 20 == 3
                        else rng.randint(100, 300), 64, 0.0) for i in range(n)))


def share(policy: str, seed: int) -> float:
    # decode KV holds about one batch of ~11 short requests; the pool holds all of them
    config = make_config(policy=policy, num_decode_blocks=160, num_staging_blocks=256,
                         num_prefill_blocks=512, max_prefill_tokens=8192, min_requests=8,
                         max_batch_size=64, max_position_embeddings=2048, host_pool_gb=1.0)
    cost = cost_model()
    probe = SimContext(ClusterConfig.from_engine(config, 1), cost,
                       get_policy(policy, PolicyConfig.of(SchedulerConfig(), 4096)))
    engine = run_on_virtual_clock(config, cost, probe, short_long(100, seed), aborts={})
    assert not engine.stats()["live"]  # every request finished
    return aligned_share(list(engine.iterations))


@pytest.mark.parametrize("seed", [0, 1])
def test_aligned_strict_keeps_iterations_aligned_where_fcfs_mixes(seed: int) -> None:
    strict, loose, fcfs = (share(p, seed) for p in ("aligned-strict", "aligned-loose", "fcfs"))
    print(f"seed {seed}: aligned iterations: aligned-strict {strict:.2f}, "
          f"aligned-loose {loose:.2f}, fcfs {fcfs:.2f}")
    assert strict >= 0.85, strict
    assert fcfs <= 0.2, fcfs
    assert loose >= 2 * fcfs, (loose, fcfs)
