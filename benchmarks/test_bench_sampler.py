"""Benchmark: the sampler at decode shapes (greedy rows over opt-125m's and SmolLM2's
vocabularies), with and without the chosen tokens' logprobs, and the blockwise argmax
beside torch's. Prints a table.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest
import torch

from bench.metrics import median_range
from models.sampler import SamplingTensors, argmax, sample

pytestmark = pytest.mark.bench

VOCABS = {"opt-125m": 50272, "smollm2-135m": 49152}
ROUNDS = 9  # interleaved rounds; each times every variant once


def greedy(rows: int, logprobs: bool) -> SamplingTensors:
    return SamplingTensors.from_lists([0.0] * rows, [1.0] * rows, [-1] * rows, [None] * rows,
                                      "cpu", logprobs=[logprobs] * rows)


def test_sampler_at_decode_shapes() -> None:
    print(f"\nsampler over bf16 logits, ms: median [min-max] of {ROUNDS} interleaved rounds; "
          f"{torch.get_num_threads()} threads; load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    g = torch.Generator().manual_seed(0)
    for name, vocab in VOCABS.items():
        for rows in (1, 16, 64):
            logits = torch.randn(rows, vocab, generator=g).bfloat16()  # [rows, vocab]
            wide = logits.float()  # [rows, vocab]
            fns: dict[str, Callable[[], object]] = {
                "sample": lambda: sample(logits, greedy(rows, False)),
                "sample + logprobs": lambda: sample(logits, greedy(rows, True)),
                "torch.argmax": lambda: wide.argmax(dim=-1),
                "blockwise argmax": lambda: argmax(wide),
            }
            times: dict[str, list[float]] = {k: [] for k in fns}
            for fn in fns.values():
                fn()  # warm-up
            for _ in range(ROUNDS):
                for key, fn in fns.items():
                    start = time.perf_counter()
                    fn()
                    times[key].append((time.perf_counter() - start) * 1e3)
            assert torch.equal(argmax(wide), wide.argmax(dim=-1))
            print(f"{name:13} rows {rows:3}  " + "  ".join(
                f"{key} {median_range(t)}" for key, t in times.items()), flush=True)
