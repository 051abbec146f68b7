"""A family of decode-heavy workloads: each member a short/long prompt mix with its own
short share, long-prompt length, outputs, size and decode KV capacity, drawn from one seed.

A policy tuned on one workload can fail on its neighbours; the family is how the
benchmarks sample those neighbours (benchmarks/test_bench_family.py). Imports no torch.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from bench.workloads import Workload, synthetic

# The family's ranges: short share, long prompts as a multiple of the short prompts' mean,
# output tokens, decode KV as a share of every request's KV at its final length, requests.
SHORT_SHARE = (0.60, 0.95)
LONG_RATIO = (2.0, 10.0)
OUTPUT_TOKENS = (32, 256)
DECODE_KV_SHARE = (0.15, 1.0)
NUM_REQUESTS = (32, 256)
SHORT_LOW = (16, 64)  # the short prompts' range: its low end drawn here...
SHORT_HIGH = (128, 320)  # ...and its high end here
LONG_SPREAD = 0.2  # long prompts: uniform within this share either side of their mean


@dataclass(frozen=True, slots=True)
class Member:
    """One workload of the family and the decode KV it is served with."""

    workload: Workload
    short_share: float
    long_ratio: float  # long prompts' mean / short prompts' mean
    output_range: tuple[int, int]
    decode_kv_share: float  # decode KV / all requests' KV at their final length

    @property
    def name(self) -> str:
        return self.workload.name

    def num_decode_blocks(self, block_size: int, batch_kv_fraction: float = 0.9) -> int:
        """Decode KV blocks: ``decode_kv_share`` of every request's blocks at its final
        length, and at least room for the longest request within ``batch_kv_fraction``."""
        blocks = [-(-(r.prompt_len + r.output_len) // block_size)
                  for r in self.workload.requests]
        return max(round(self.decode_kv_share * sum(blocks)),
                   math.ceil(max(blocks) / batch_kv_fraction) + 1)

    def describe(self) -> str:
        lo, hi = self.output_range
        return (f"{self.workload.num_requests} req, short {self.short_share:.0%}, "
                f"long {self.long_ratio:.1f}x, out {lo}-{hi}, decode KV "
                f"{self.decode_kv_share:.0%}")


def sample_family(count: int, seed: int, num_requests: tuple[int, int] = NUM_REQUESTS,
                  output_tokens: tuple[int, int] = OUTPUT_TOKENS,
                  max_len: int | None = None) -> list[Member]:
    """``count`` members drawn from ``seed`` (the same seed, the same members).
    ``num_requests`` and ``output_tokens`` narrow the family's ranges (an engine run on a
    CPU takes the small end); ``max_len`` caps a request's prompt plus output.

    Raises:
        ValueError: for count < 1 or a range outside the family's.
    """
    if count < 1:
        raise ValueError(f"count ({count}) must be >= 1")
    for name, got, full in (("num_requests", num_requests, NUM_REQUESTS),
                            ("output_tokens", output_tokens, OUTPUT_TOKENS)):
        if not full[0] <= got[0] <= got[1] <= full[1]:
            raise ValueError(f"{name} {got} must lie within {full}")
    rng = random.Random(f"family/{seed}")
    members = []
    for i in range(count):
        short_share = rng.uniform(*SHORT_SHARE)
        long_ratio = rng.uniform(*LONG_RATIO)
        short_range = (rng.randint(*SHORT_LOW), rng.randint(*SHORT_HIGH))
        long_mean = long_ratio * sum(short_range) / 2
        long_range = (round(long_mean * (1 - LONG_SPREAD)), round(long_mean * (1 + LONG_SPREAD)))
        out_lo = rng.randint(*output_tokens)
        output_range = (out_lo, rng.randint(out_lo, output_tokens[1]))
        n = rng.randint(*num_requests)
        workload = synthetic(n, short_ratio=short_share, short_range=short_range,
                             long_range=long_range, output_range=output_range,
                             max_len=max_len, seed=rng.randrange(2**31))
        members.append(Member(Workload(f"family{seed}-{i}", workload.requests), short_share,
                              long_ratio, output_range, rng.uniform(*DECODE_KV_SHARE)))
    return members
