"""Benchmark metrics computed from lifecycle events and iteration records only.

Per request: TTFT, TPOT, end-to-end. Per run: throughput, latency percentiles, goodput and
iteration statistics. Imports no torch; nothing in the package imports it.

Latency follows the paper and DistServe's harness: a request's TPOT is (last token time -
first token time) / (n - 1) over its n output tokens, so it includes every wait between
tokens (in the pool, in staging, behind another batch); the per-iteration latency is the
forward time of each decode iteration. Goodput counts the requests (and their tokens) that
meet a TPOT SLO, DEFAULT_TPOT_SLO unless the caller names one. Engine runs (bench.harness)
and simulated runs (sim.run) are summarised by this one module.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from aserve.engine.sequence import Event, IterationRecord, TransferRecord

ALIGNED_RATIO = 1.5  # an iteration is aligned when max_len / min_len <= this
# DistServe's TPOT SLO for its chatbot on OPT-13B (0.1 s): decoding at >= 10 tokens/s, about
# reading speed. `aserve bench --tpot-slo` and `aserve sim --tpot-slo` change it.
DEFAULT_TPOT_SLO = 0.1  # seconds

_Pred = Callable[[IterationRecord], bool]


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """One finished request's timings, in seconds (same clock as the events).

    A request that ended before its first token (abort, error) has `first_token` and
    `ttft` None; `tpot` is None unless it produced at least two tokens.
    """

    seq_id: str
    arrival: float
    first_token: float | None
    finish: float
    num_output_tokens: int  # the first token plus one per "token" event
    ttft: float | None  # first_token - arrival
    tpot: float | None  # (last token - first token) / (n - 1); None for n < 2
    e2e: float  # finish - arrival
    num_evictions: int  # "evicted" events: times its KV was pushed out of a decode cache


@dataclass(frozen=True, slots=True)
class Summary:
    """What one benchmark row reports for one system. Percentiles are NaN on no data."""

    system: str
    num_requests: int
    num_output_tokens: int
    duration: float  # first arrival -> last finish, seconds
    decode_throughput: float  # generated tokens (first token included) / duration
    request_throughput: float  # finished requests / duration
    tpot_slo: float  # the TPOT target of the goodput figures (seconds; inf: none)
    goodput: float  # requests meeting the TTFT target and the TPOT SLO / duration
    goodput_tokens: float  # output tokens of those requests / duration
    slo_attainment: float  # share of requests meeting them
    ttft_mean: float
    ttft_p50: float
    ttft_p99: float
    tpot_mean: float
    tpot_p50: float
    tpot_p99: float
    e2e_mean: float
    e2e_p99: float
    mixed_iteration_share: float  # iterations that ran two batches together
    aligned_iteration_share: float  # decode iterations with max_len / min_len <= 1.5
    iteration_latency_mean: float  # forward time of decode iterations with >= 1 sequence
    iteration_latency_p50: float
    iteration_latency_p99: float
    forward_time_p50: float  # every record, idle steps included
    forward_time_p99: float
    schedule_time_p50: float
    schedule_time_p99: float
    peak_blocks: dict[str, int]  # blocks_used key (a KV store, e.g. "decode1") -> peak


def median_range(values: Iterable[float], digits: int = 2) -> str:
    """"median [min–max]" of the finite values (the median alone for one; "–" for none):
    how repeated runs or samples are reported."""
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return "–"
    mid = f"{statistics.median(finite):.{digits}f}"
    if len(finite) == 1:
        return mid
    return f"{mid} [{min(finite):.{digits}f}–{max(finite):.{digits}f}]"


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation (numpy's default method).

    Returns NaN for no values.

    Raises:
        ValueError: if q is outside [0, 100].
    """
    if not 0 <= q <= 100:
        raise ValueError(f"q ({q}) must be in [0, 100]")
    ordered = sorted(values)
    if not ordered:
        return math.nan
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def mean(values: Iterable[float]) -> float:
    """Arithmetic mean; NaN for no values."""
    items = list(values)
    return math.fsum(items) / len(items) if items else math.nan


def request_metrics(events: Iterable[Event]) -> list[RequestMetrics]:
    """Per-request metrics, ordered by arrival then seq_id.

    Requests with no "finish" event (still in flight) are left out.

    Raises:
        ValueError: if a finished request has no "arrival" event.
    """
    by_seq: dict[str, list[Event]] = defaultdict(list)
    for event in events:
        by_seq[event.seq_id].append(event)
    out = [_one_request(seq_id, evs) for seq_id, evs in by_seq.items()]
    done = [m for m in out if m is not None]
    done.sort(key=lambda m: (m.arrival, m.seq_id))
    return done


def _one_request(seq_id: str, events: list[Event]) -> RequestMetrics | None:
    times: dict[str, list[float]] = defaultdict(list)
    for event in events:
        times[event.kind].append(event.time)
    if not times["finish"]:
        return None
    if not times["arrival"]:
        raise ValueError(f"request {seq_id!r} has a finish event but no arrival event")
    arrival, finish = min(times["arrival"]), max(times["finish"])
    first = min(times["first_token"]) if times["first_token"] else None
    token_times = sorted(times["token"])
    num_tokens = (1 + len(token_times)) if first is not None else 0
    tpot = None
    if first is not None and token_times:
        tpot = (token_times[-1] - first) / len(token_times)
    return RequestMetrics(
        seq_id=seq_id,
        arrival=arrival,
        first_token=first,
        finish=finish,
        num_output_tokens=num_tokens,
        ttft=None if first is None else first - arrival,
        tpot=tpot,
        e2e=finish - arrival,
        num_evictions=len(times["evicted"]),
    )


def summarize(
    system: str,
    events: Iterable[Event],
    iterations: Sequence[IterationRecord],
    ttft_target: float = math.inf,
    tpot_target: float = DEFAULT_TPOT_SLO,
) -> Summary:
    """One benchmark row from a run's events and iteration records.

    Goodput counts requests with a first token, TTFT <= ttft_target and (if it has a TPOT)
    TPOT <= tpot_target; with both targets infinite every request with a token counts.
    """
    reqs = request_metrics(events)
    duration = _duration(reqs)
    ttfts = [m.ttft for m in reqs if m.ttft is not None]
    tpots = [m.tpot for m in reqs if m.tpot is not None]
    e2es = [m.e2e for m in reqs]
    num_tokens = sum(m.num_output_tokens for m in reqs)
    good = [m for m in reqs if _meets(m, ttft_target, tpot_target)]
    forward = [it.forward_time for it in iterations]
    latency = [it.forward_time for it in iterations if it.batch_size >= 1]
    schedule = [it.schedule_time for it in iterations]
    return Summary(
        system=system,
        num_requests=len(reqs),
        num_output_tokens=num_tokens,
        duration=duration,
        decode_throughput=_rate(num_tokens, duration),
        request_throughput=_rate(len(reqs), duration),
        tpot_slo=tpot_target,
        goodput=_rate(len(good), duration),
        goodput_tokens=_rate(sum(m.num_output_tokens for m in good), duration),
        slo_attainment=len(good) / len(reqs) if reqs else math.nan,
        ttft_mean=mean(ttfts),
        ttft_p50=percentile(ttfts, 50),
        ttft_p99=percentile(ttfts, 99),
        tpot_mean=mean(tpots),
        tpot_p50=percentile(tpots, 50),
        tpot_p99=percentile(tpots, 99),
        e2e_mean=mean(e2es),
        e2e_p99=percentile(e2es, 99),
        mixed_iteration_share=_share(iterations, lambda it: it.is_mixed),
        aligned_iteration_share=aligned_share(iterations),
        iteration_latency_mean=mean(latency),
        iteration_latency_p50=percentile(latency, 50),
        iteration_latency_p99=percentile(latency, 99),
        forward_time_p50=percentile(forward, 50),
        forward_time_p99=percentile(forward, 99),
        schedule_time_p50=percentile(schedule, 50),
        schedule_time_p99=percentile(schedule, 99),
        peak_blocks=peak_blocks(iterations),
    )


def median_summary(summaries: Sequence[Summary]) -> Summary:
    """One row for repeated runs of one system: every float figure is its median over the
    runs (NaN ones left out; the mean of the middle two for an even count), the rest is the
    first run's (the system, counts and SLO are the same in every run).

    Raises:
        ValueError: for no runs, or runs of different systems.
    """
    if not summaries or len({s.system for s in summaries}) != 1:
        raise ValueError(f"median_summary needs runs of one system, got "
                         f"{[s.system for s in summaries]}")
    medians: dict[str, Any] = {}  # Summary's float fields by name
    for f in fields(Summary):
        values = [v for s in summaries if isinstance(v := getattr(s, f.name), float)
                  and not math.isnan(v)]
        if isinstance(getattr(summaries[0], f.name), float):
            medians[f.name] = statistics.median(values) if values else math.nan
    return replace(summaries[0], **medians)


def aligned_share(iterations: Sequence[IterationRecord]) -> float:
    """Share of decode iterations (batch_size >= 1, min_len >= 1) whose longest prefix is at
    most ALIGNED_RATIO times the shortest. NaN when there are none."""
    decode = [it for it in iterations if it.batch_size >= 1 and it.min_len >= 1]
    return _share(decode, lambda it: it.max_len <= ALIGNED_RATIO * it.min_len)


def peak_blocks(iterations: Sequence[IterationRecord]) -> dict[str, int]:
    """Each blocks_used key (a KV store or location) -> the most blocks in use after any step.

    Keys are taken as the records give them: per-instance store names stay separate.
    """
    peaks: dict[str, int] = {}
    for it in iterations:
        for location, num_blocks in it.blocks_used.items():
            peaks[location] = max(peaks.get(location, 0), num_blocks)
    return peaks


def _share(items: Sequence[IterationRecord], pred: _Pred) -> float:
    return sum(1 for it in items if pred(it)) / len(items) if items else math.nan


def _duration(reqs: Sequence[RequestMetrics]) -> float:
    if not reqs:
        return 0.0
    return max(m.finish for m in reqs) - min(m.arrival for m in reqs)


def _rate(count: int, duration: float) -> float:
    return count / duration if duration > 0 else math.nan


def _meets(m: RequestMetrics, ttft_target: float, tpot_target: float) -> bool:
    if m.ttft is None or m.ttft > ttft_target:
        return False
    return m.tpot is None or m.tpot <= tpot_target


def hidden_transfer_share(transfers: Sequence[TransferRecord],
                          iterations: Sequence[IterationRecord],
                          src_prefix: str = "host", dst_prefix: str = "staging") -> float:
    """Share of KV-copy time (moves from `src_prefix*` to `dst_prefix*` stores) that ran
    while a forward pass was running, i.e. was hidden behind an iteration.

    A forward interval is [start_time, start_time + forward_time] of each iteration record.
    NaN when no such transfer happened.
    """
    forwards = sorted((r.start_time, r.start_time + r.forward_time) for r in iterations)
    chosen = [t for t in transfers
              if t.src.startswith(src_prefix) and t.dst.startswith(dst_prefix)]
    total = sum(t.end_time - t.start_time for t in chosen)
    if not chosen or total <= 0:
        return float("nan")
    hidden = 0.0
    for t in chosen:
        for lo, hi in forwards:
            if lo >= t.end_time:
                break
            hidden += max(0.0, min(hi, t.end_time) - max(lo, t.start_time))
    return hidden / total
