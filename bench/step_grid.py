"""Decode steps timed over a grid of batch sizes, lengths and spreads on this machine's
engine: the start-up probe's synthetic steps (aserve/engine/step_probe.py), over the range
a simulated workload family reaches rather than what one engine's cache holds, written as
iteration records that scheduler/calibrate.py fits.

    python -m bench.step_grid --attention padded --out benchmarks/data/padded_grid.jsonl

A cost model fitted to a narrow probe extrapolates: past the probe's sizes it can miss a
step's time by 2x, and a simulator calibrated on it then misprices the batches a policy
forms there. Prints one line per step (seqs, shortest, longest, ms).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

from aserve import Engine
from aserve.engine.config import EngineConfig
from aserve.engine.step_probe import hardware_name, timed_steps
from scheduler import ceil_div

BLOCK_SIZE = 16
SIZES = (1, 4, 16, 48, 96)  # seqs per uniform step
LENGTHS = (64, 256, 1024, 2000)  # KV tokens per seq of a uniform step
SPREADS = ((64, 512), (64, 2000), (256, 1024))  # (short, long) of the mixed steps
MIXED_SIZES = (8, 32)  # seqs per mixed step: one long among shorts, and half and half
MAX_BLOCKS = 8_100  # the uniform steps' KV at most (blocks of BLOCK_SIZE tokens)


def grid(max_blocks: int) -> list[list[int]]:
    """The steps' KV lengths: uniform steps of every size and length whose KV fits
    ``max_blocks`` blocks, then mixed ones of every spread."""
    steps = [[length] * size for size in SIZES for length in LENGTHS
             if size * ceil_div(length + 1, BLOCK_SIZE) <= max_blocks]
    for size in MIXED_SIZES:
        for short, long in SPREADS:
            steps.append([short] * (size - 1) + [long])
            steps.append([short] * (size // 2) + [long] * (size // 2))
    return steps


async def run(model: str, dtype: str, attention: str, device: str
              ) -> tuple[dict[str, object], list[dict[str, object]]]:
    """The grid's steps timed on an engine of ``model`` on ``device``: the records' header
    and the records (as dicts)."""
    steps = grid(MAX_BLOCKS)
    blocks = max(sum(ceil_div(n + 1, BLOCK_SIZE) for n in step) for step in steps) + 1
    config = EngineConfig.create(
        model=model, dtype=dtype, attention=attention, block_size=BLOCK_SIZE,
        num_decode_blocks=blocks, num_prefill_blocks=256, num_staging_blocks=256,
        host_pool_gb=0.2, max_batch_size=max(map(len, steps)), policy="fcfs",
        prefill_devices=(device,), decode_devices=(device,))
    async with Engine(config) as engine:
        ctx = engine.ctx
        assert ctx is not None  # a started engine
        runner: Any = ctx.runners[config.decode_devices[0]]  # a ModelRunner
        records = await runner.call(timed_steps, runner, ctx.kv["decode0"].tensor, steps,
                                    BLOCK_SIZE)
    header: dict[str, object] = {"model": model, "dtype": dtype, "attention": attention,
              "hardware": hardware_name(device)}
    return header, [dataclasses.asdict(r) for r in records]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="opt-125m", help="preset or checkpoint (default opt-125m)")
    p.add_argument("--dtype", default="bfloat16", help="default bfloat16")
    p.add_argument("--attention", default="padded", help="attention backend (default padded)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--out", type=Path, required=True, help="iteration records (.jsonl)")
    args = p.parse_args(argv)
    header, records = asyncio.run(run(args.model, args.dtype, args.attention, args.device))
    with args.out.open("w") as f:
        f.write(json.dumps({"header": header}) + "\n")
        for record in records:
            f.write(json.dumps(record) + "\n")
    for r in records:
        print(f"{r['batch_size']:3} seqs, {r['min_len']:5}-{r['max_len']:5} tokens: "
              f"{1000 * float(r['forward_time']):8.1f} ms")  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
