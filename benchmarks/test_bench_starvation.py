"""Starvation control with the real model on the wall clock: how long a long request waits
for decode while short requests keep arriving, with and without the threshold. A benchmark,
not a CI test: the figures depend on the machine's speed (the deterministic check is
tests/cores/test_starvation.py). Run with `pytest -q -s -m bench
benchmarks/test_bench_starvation.py`."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from aserve import Engine, SamplingParams
from tests.aserve.test_engine import collect, settle
from tests.conftest import make_config

pytestmark = pytest.mark.bench

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


async def test_starvation_control_bounds_a_long_requests_wait() -> None:
    threshold = 0.3
    wait_on, done_on = await long_request_wait(threshold)
    wait_off, done_off = await long_request_wait(None)
    print(f"long request: enters decode {wait_on:.2f} s / ends {done_on:.2f} s after pooling "
          f"with a {threshold} s threshold; {wait_off:.2f} s / {done_off:.2f} s without")
    # measured on the 2-core CPU: with control the long request enters decode 1.0-1.5 s
    # after pooling (threshold, then the running batch drains to make room for its 38
    # blocks); without, only once the stream of short requests has drained, 4.6-6.1 s
    assert wait_off > 2 * wait_on, (wait_on, wait_off)
    assert done_off > 2 * done_on, (done_on, done_off)
    assert wait_off > threshold
