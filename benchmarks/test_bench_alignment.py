"""Prefix-aware batching with the real model on the wall clock: share of decode iterations
within 1.5x under aligned-strict, aligned-loose and fcfs, from the engine's own records. A
benchmark: the batches formed depend on how prefill and decode steps interleave in real time
(under load aligned-strict once fell to 0.82). The deterministic check is
tests/cores/test_alignment.py. Run with `pytest -q -s -m bench
benchmarks/test_bench_alignment.py`."""

from __future__ import annotations

import asyncio
import random

import pytest

from aserve import Engine, SamplingParams
from aserve.engine.sequence import IterationRecord
from tests.aserve.test_engine import collect, settle
from tests.conftest import make_config

pytestmark = pytest.mark.bench


def aligned_share(iterations: list[IterationRecord]) -> float:
    """Share of decode iterations whose longest prefix is at most 1.5x the shortest."""
    return sum(r.max_len <= 1.5 * r.min_len for r in iterations) / len(iterations)


def short_long_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """95 % short prompts (100-300 tokens), 5 % long ones (1000-1400)."""
    rng = random.Random(seed)
    return [[rng.randrange(4, 500) for _ in range(rng.randint(1000, 1400) if i % 20 == 3
                                                  else rng.randint(100, 300))]
            for i in range(n)]


async def run_pool(policy: str, prompts: list[list[int]]) -> list[IterationRecord]:
    # decode KV holds about one batch of ~11 short requests; the pool holds all of them
    config = make_config(policy=policy, num_decode_blocks=160, num_staging_blocks=256,
                         num_prefill_blocks=512, max_prefill_tokens=8192, min_requests=8,
                         max_batch_size=64, max_position_embeddings=2048, host_pool_gb=1.0)
    async with Engine(config) as engine:
        await asyncio.gather(*(collect(engine, p, SamplingParams(max_tokens=64,
                                                                 ignore_eos=True))
                               for p in prompts))
        await settle(engine)
        return list(engine.iterations)


async def test_aligned_strict_keeps_iterations_aligned_where_fcfs_mixes() -> None:
    prompts = short_long_prompts(100)
    aligned = aligned_share(await run_pool("aligned-strict", prompts))
    loose = aligned_share(await run_pool("aligned-loose", prompts))
    fcfs = aligned_share(await run_pool("fcfs", prompts))
    print(f"aligned iterations: aligned-strict {aligned:.2f}, aligned-loose {loose:.2f}, "
          f"fcfs {fcfs:.2f}")
    # measured on the 2-core CPU over prompt seeds 0-3: aligned-strict (max_spread 1.5) 1.00,
    # aligned-loose (the paper's rules without the bound) 0.62-0.74, fcfs 0.06-0.11. The
    # default `aligned` decides by predicted throughput instead, which
    # on the paged backend keeps batches full rather than aligned.
    assert aligned >= 0.85, aligned
    assert fcfs <= 0.2, fcfs
    assert loose >= 4 * fcfs, (loose, fcfs)
