"""Prefix-aware batching in the engine: iterations stay aligned where FCFS mixes lengths, and
starvation control bounds a long request's wait. Figures come from the engine's own records."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from aserve import Engine, SamplingParams
from aserve.core import IterationRecord
from tests.aserve.test_engine import collect, settle
from tests.conftest import make_config


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


@pytest.mark.slow
async def test_aligned_strict_keeps_iterations_aligned_where_fcfs_mixes() -> None:
    prompts = short_long_prompts(100)
    aligned = aligned_share(await run_pool("aligned-strict", prompts))
    loose = aligned_share(await run_pool("aligned-loose", prompts))
    fcfs = aligned_share(await run_pool("fcfs", prompts))
    # measured on the 2-core CPU over prompt seeds 0-3: aligned-strict (max_spread 1.5) 1.00,
    # aligned-loose (the paper's rules without the bound) 0.62-0.74, fcfs 0.06-0.11 (see
    # the issue note). The default `aligned` decides by predicted throughput instead, which
    # on the paged backend keeps batches full rather than aligned (benchmarks/RESULTS.md).
    assert aligned >= 0.85, aligned
    assert fcfs <= 0.2, fcfs
    assert loose >= 4 * fcfs, (loose, fcfs)


NUM_SHORT_GROUPS = 20  # groups of 8 short requests, one group every 40 ms
STEP_DELAY = 0.015  # seconds added to every forward step
LONG_AFTER = 16  # short requests sent before the long one
LONG_PROMPT = 600  # tokens: 38 blocks, so it cannot share a batch budget (43) with 2 shorts


async def long_request_wait(starvation_threshold: float | None) -> tuple[float, float]:
    """Seconds a long request waits from the pool to its first decode step, and to its end,
    while short requests keep arriving."""
    config = make_config(policy="aligned", num_decode_blocks=48, min_requests=4,
                         max_batch_size=16, starvation_threshold=starvation_threshold)
    rng = random.Random(1)
    async with Engine(config) as engine:
        # NOTE: every step takes at least 15 ms, so the stream below outpaces decode on any
        # machine (a fast, idle CPU would otherwise drain the pool and nothing would starve)
        for runner in engine.ctx.runners.values():  # type: ignore[union-attr]
            runner.fault_hook = lambda: time.sleep(STEP_DELAY)
        shorts, long_task = [], None
        for i in range(NUM_SHORT_GROUPS * 8):  # a steady stream, faster than decode drains it
            shorts.append(asyncio.ensure_future(collect(
                engine, [rng.randrange(4, 500) for _ in range(rng.randint(20, 40))],
                SamplingParams(max_tokens=24, ignore_eos=True), f"s{i}")))
            if i % 8 == 7:
                await asyncio.sleep(0.04)
            if i == LONG_AFTER:  # after the first batches formed, so it cannot join them
                long_task = asyncio.ensure_future(collect(
                    engine, [rng.randrange(4, 500) for _ in range(LONG_PROMPT)],
                    SamplingParams(max_tokens=8, ignore_eos=True), "long"))
        assert long_task is not None
        await asyncio.wait_for(asyncio.gather(long_task, *shorts), timeout=120)
        times: dict[str, float] = {}
        for e in engine.events:  # the first of each kind
            if e.seq_id == "long":
                times.setdefault(e.kind, e.time)
        finish = times["finish"]
        await settle(engine)
    return times["decode_start"] - times["pooled"], finish - times["pooled"]


@pytest.mark.slow
async def test_starvation_control_bounds_a_long_requests_wait() -> None:
    threshold = 0.3
    wait_on, done_on = await long_request_wait(threshold)
    wait_off, done_off = await long_request_wait(None)
    # measured on the 2-core CPU: with control the long request enters decode 1.0-1.5 s
    # after pooling (threshold, then the running batch drains to make room for its 38
    # blocks); without, only once the stream of short requests has drained, 4.6-6.1 s
    assert wait_off > 2 * wait_on, (wait_on, wait_off)
    assert done_off > 2 * done_on, (done_on, done_off)
    assert wait_off > threshold
