"""Benchmark workloads: synthetic short/long mixes and replays of real traces (bench/data/).

A workload is only lengths and arrival times; prompt token ids are drawn from a seed so every
system sees the same tokens. Imports no torch, and nothing in the package imports it.
"""

from __future__ import annotations

import csv
import functools
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import date
from pathlib import Path
from typing import Any, Literal

DATA_DIR = Path(__file__).resolve().parent / "data"
AZURE_FILES = {
    "code": DATA_DIR / "azure" / "AzureLLMInferenceTrace_code.csv",
    "conv": DATA_DIR / "azure" / "AzureLLMInferenceTrace_conv.csv",
}
SHAREGPT4_FILE = DATA_DIR / "openchat_sharegpt4" / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"
MIN_TOKEN_ID = 4  # OPT reserves ids 0..3 (<s>, <pad>, </s>, <unk>)
TICKS_PER_SECOND = 10_000_000  # Azure timestamps carry 7 fractional digits (100 ns ticks)


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    """One request of a workload: its lengths and when it arrives."""

    request_id: str
    prompt_len: int  # tokens, >= 1
    output_len: int  # tokens to generate, >= 1
    arrival_time: float  # seconds from the start of the replay (0 for offline)


@dataclass(frozen=True, slots=True)
class Workload:
    """A named, ordered tuple of requests (sorted by arrival time)."""

    name: str
    requests: tuple[WorkloadRequest, ...]

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    def prompt_token_ids(self, req: WorkloadRequest, vocab_size: int, seed: int) -> list[int]:
        """Deterministic random prompt ids in [4, vocab_size), from (seed, request_id) only.

        Raises:
            ValueError: if vocab_size leaves no id above OPT's special tokens 0..3.
        """
        if vocab_size <= MIN_TOKEN_ID:
            raise ValueError(f"vocab_size ({vocab_size}) must be > {MIN_TOKEN_ID}")
        # NOTE: a str seed is hashed with sha512 by `random`, so ids are stable across runs
        # and processes (unlike hash(), which is salted per process).
        rng = random.Random(f"{seed}/{req.request_id}")
        return rng.choices(range(MIN_TOKEN_ID, vocab_size), k=req.prompt_len)

    def offline(self) -> Workload:
        """The same requests, all arriving at time 0."""
        reqs = tuple(replace(r, arrival_time=0.0) for r in self.requests)
        return Workload(f"{self.name}-offline", reqs)

    def with_rate(self, rate: float) -> Workload:
        """Rescale arrival times so the mean rate, (n - 1) / span, is `rate` req/s.

        Raises:
            ValueError: if rate is not > 0, or the arrivals have no spread to rescale.
        """
        if not rate > 0:
            raise ValueError(f"rate ({rate}) must be > 0 req/s")
        times = [r.arrival_time for r in self.requests]
        span = max(times, default=0.0) - min(times, default=0.0)
        if len(times) < 2 or span <= 0:
            raise ValueError(
                f"workload {self.name!r} has no arrival spread (span {span} s over "
                f"{len(times)} requests); build it with a rate instead"
            )
        factor = (len(times) - 1) / (rate * span)
        t0 = min(times)
        reqs = tuple(replace(r, arrival_time=(r.arrival_time - t0) * factor) for r in self.requests)
        return Workload(f"{self.name}@{rate:g}rps", reqs)


def synthetic(
    num_requests: int,
    short_ratio: float = 0.95,
    short_range: tuple[int, int] = (16, 1000),
    long_range: tuple[int, int] = (1000, 8000),
    output_range: tuple[int, int] | int = (16, 256),
    rate: float | None = None,
    length_scale: float = 1.0,
    max_len: int | None = None,
    seed: int = 0,
) -> Workload:
    """A short/long mix: exactly round(short_ratio * n) short prompts, in seeded order.

    Lengths are uniform over each inclusive range; `output_range` may be one fixed length.
    Arrivals are Poisson at `rate` req/s (first at 0), or all at 0 when `rate` is None.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests ({num_requests}) must be >= 1")
    if not 0 <= short_ratio <= 1:
        raise ValueError(f"short_ratio ({short_ratio}) must be in [0, 1]")
    out_range = (output_range, output_range) if isinstance(output_range, int) else output_range
    for field, bounds in (("short_range", short_range), ("long_range", long_range),
                          ("output_range", out_range)):
        if not 1 <= bounds[0] <= bounds[1]:
            raise ValueError(f"{field} {bounds} must satisfy 1 <= low <= high")
    rng = random.Random(f"synthetic/{seed}")
    num_short = round(short_ratio * num_requests)
    is_short = [True] * num_short + [False] * (num_requests - num_short)
    rng.shuffle(is_short)
    lengths = [
        (rng.randint(*(short_range if short else long_range)), rng.randint(*out_range))
        for short in is_short
    ]
    arrivals = _poisson_arrivals(num_requests, rate, seed)
    return _build(f"synthetic-s{short_ratio:g}", lengths, arrivals, length_scale, max_len)


def azure(
    kind: Literal["code", "conv"],
    num_requests: int | None = None,
    length_scale: float = 1.0,
    rate_scale: float = 1.0,
    offline: bool = False,
    max_len: int | None = None,
    seed: int = 0,
) -> Workload:
    """Replay an Azure 2023 trace with its own arrival times, relative to the first replayed.

    A subset is a contiguous window of `num_requests` rows whose start is drawn from `seed`
    (the trace's burstiness is kept). `rate_scale` > 1 compresses time (a faster replay).
    """
    if kind not in AZURE_FILES:
        raise ValueError(f"kind ({kind!r}) must be one of {sorted(AZURE_FILES)}")
    if not rate_scale > 0:
        raise ValueError(f"rate_scale ({rate_scale}) must be > 0")
    rows = _read_azure(kind)
    count = _check_count(num_requests, len(rows))
    start = random.Random(f"azure/{seed}").randrange(len(rows) - count + 1)
    window = rows[start : start + count]
    t0 = window[0][0]
    arrivals = [0.0 if offline else (t - t0) / TICKS_PER_SECOND / rate_scale for t, _, _ in window]
    lengths = [(p, o) for _, p, o in window]
    return _build(f"azure-{kind}", lengths, arrivals, length_scale, max_len)


def sharegpt4(
    num_requests: int | None = None,
    length_scale: float = 1.0,
    rate: float | None = None,
    max_len: int | None = None,
    seed: int = 0,
) -> Workload:
    """OpenChat ShareGPT4 lengths; a subset is a seeded sample without replacement.

    The file has no times: arrivals are Poisson at `rate` req/s, or all at 0 when None.
    """
    rows = _read_sharegpt4()
    count = _check_count(num_requests, len(rows))
    if num_requests is None:
        lengths = list(rows)
    else:
        picked = random.Random(f"sharegpt4/{seed}").sample(range(len(rows)), count)
        lengths = [rows[i] for i in picked]
    arrivals = _poisson_arrivals(count, rate, seed)
    return _build("sharegpt4", lengths, arrivals, length_scale, max_len)


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "synthetic": synthetic,
    "azure-code": functools.partial(azure, "code"),
    "azure-conv": functools.partial(azure, "conv"),
    "sharegpt4": sharegpt4,
}


def load_workload(name: str, **kw: Any) -> Workload:
    """Build a workload by name with the keyword arguments of its builder.

    Raises:
        ValueError: for an unknown name (the message lists the known ones).
    """
    if name not in WORKLOADS:
        raise ValueError(f"workload ({name!r}) must be one of {sorted(WORKLOADS)}")
    return WORKLOADS[name](**kw)


def parse_timestamp_ticks(text: str) -> int:
    """`YYYY-MM-DD HH:MM:SS.fffffff` -> 100 ns ticks since 0001-01-01, exactly (no float)."""
    day, clock = text.strip().split(" ")
    hours, minutes, seconds = clock.split(":")
    whole, _, frac = seconds.partition(".")
    if len(frac) > 7:
        raise ValueError(f"timestamp ({text!r}) has {len(frac)} fractional digits; max is 7")
    total_s = date.fromisoformat(day).toordinal() * 86_400
    total_s += int(hours) * 3600 + int(minutes) * 60 + int(whole)
    return total_s * TICKS_PER_SECOND + int(frac.ljust(7, "0"))


def scale_and_clip(
    prompt_len: int, output_len: int, length_scale: float, max_len: int | None
) -> tuple[int, int]:
    """Scale both lengths (each >= 1 token); then, if prompt + output > max_len, trim the
    prompt first (down to 1 token) and then the output, so the decode work is kept."""
    prompt = max(1, round(prompt_len * length_scale))
    output = max(1, round(output_len * length_scale))
    if max_len is not None and prompt + output > max_len:
        prompt = max(1, max_len - output)
        output = max_len - prompt
    return prompt, output


def _build(
    name: str,
    lengths: list[tuple[int, int]],
    arrivals: list[float],
    length_scale: float,
    max_len: int | None,
) -> Workload:
    if not length_scale > 0:
        raise ValueError(f"length_scale ({length_scale}) must be > 0")
    if max_len is not None and max_len < 2:
        raise ValueError(f"max_len ({max_len}) must be >= 2 (one prompt and one output token)")
    reqs = []
    for i, ((p, o), t) in enumerate(zip(lengths, arrivals, strict=True)):
        prompt, output = scale_and_clip(p, o, length_scale, max_len)
        reqs.append(WorkloadRequest(f"{name}-{i}", prompt, output, t))
    reqs.sort(key=lambda r: r.arrival_time)  # stable: trace order is kept on ties
    return Workload(name, tuple(reqs))


def _poisson_arrivals(count: int, rate: float | None, seed: int) -> list[float]:
    """First arrival at 0, then exponential gaps; a separate stream from the lengths."""
    if rate is None:
        return [0.0] * count
    if not rate > 0:
        raise ValueError(f"rate ({rate}) must be > 0 req/s, or None for offline")
    rng = random.Random(f"arrivals/{seed}")
    times = [0.0]
    for _ in range(count - 1):
        times.append(times[-1] + rng.expovariate(rate))
    return times[:count]


def _check_count(num_requests: int | None, available: int) -> int:
    if num_requests is None:
        return available
    if not 1 <= num_requests <= available:
        raise ValueError(f"num_requests ({num_requests}) must be in [1, {available}]")
    return num_requests


@functools.cache
def _read_azure(kind: str) -> tuple[tuple[int, int, int], ...]:
    """(timestamp ticks, prompt_len, output_len) per row, in file (time) order."""
    with AZURE_FILES[kind].open(newline="") as f:
        rows = csv.DictReader(f)
        return tuple(
            (parse_timestamp_ticks(r["TIMESTAMP"]), int(r["ContextTokens"]),
             int(r["GeneratedTokens"]))
            for r in rows
        )


@functools.cache
def _read_sharegpt4() -> tuple[tuple[int, int], ...]:
    with SHAREGPT4_FILE.open(newline="") as f:
        rows = csv.DictReader(f)
        return tuple((int(r["num_prefill_tokens"]), int(r["num_decode_tokens"])) for r in rows)
