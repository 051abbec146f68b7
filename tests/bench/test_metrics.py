"""Tests for bench/metrics.py on hand-made event logs with hand-computed figures."""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import pytest

from aserve.engine.sequence import Event, EventKind, IterationRecord
from bench.metrics import (
    DEFAULT_TPOT_SLO,
    median_summary,
    percentile,
    request_metrics,
    summarize,
)


def _log(seq_id: str, *steps: tuple[EventKind, float]) -> list[Event]:
    return [Event(seq_id, kind, t) for kind, t in steps]


def _events() -> list[Event]:
    """a: 4 tokens; b: 1 token; c: aborted before its first token; d: still in flight."""
    return [
        *_log("a", ("arrival", 0.0), ("prefill_start", 0.1), ("prefill_end", 0.3),
              ("first_token", 0.5), ("token", 0.7), ("evicted", 0.8), ("token", 0.9),
              ("token", 1.3), ("finish", 1.3)),
        *_log("b", ("arrival", 1.0), ("first_token", 1.2), ("finish", 1.2)),
        *_log("c", ("arrival", 0.5), ("finish", 0.6)),
        *_log("d", ("arrival", 2.0), ("first_token", 2.5)),
    ]


def _iteration(
    min_len: int, max_len: int, forward_time: float, is_mixed: bool = False,
    blocks: dict[str, int] | None = None, batch_size: int = 4, instance: str = "decode0",
) -> IterationRecord:
    return IterationRecord(
        instance=instance, start_time=0.0, batch_size=batch_size, num_prefill_tokens=0,
        min_len=min_len, max_len=max_len, forward_time=forward_time,
        schedule_time=forward_time / 10, is_mixed=is_mixed, blocks_used=blocks or {},
    )


def test_request_metrics_hand_computed() -> None:
    by_id = {m.seq_id: m for m in request_metrics(_events())}
    a, b, c = by_id["a"], by_id["b"], by_id["c"]
    assert (a.ttft, a.e2e, a.num_output_tokens) == (0.5, 1.3, 4)
    assert a.tpot == pytest.approx((1.3 - 0.5) / 3)
    assert a.num_evictions == 1
    assert b.ttft == pytest.approx(0.2) and b.tpot is None and b.num_output_tokens == 1
    assert c.ttft is None and c.first_token is None and c.num_output_tokens == 0
    assert c.e2e == pytest.approx(0.1)


def test_unfinished_requests_are_left_out_and_order_is_by_arrival() -> None:
    assert [m.seq_id for m in request_metrics(_events())] == ["a", "c", "b"]


def test_event_order_does_not_matter() -> None:
    shuffled = _events()
    random.Random(0).shuffle(shuffled)
    assert request_metrics(shuffled) == request_metrics(_events())


def test_finish_without_arrival_is_rejected() -> None:
    with pytest.raises(ValueError, match="'x'.*no arrival"):
        request_metrics(_log("x", ("first_token", 1.0), ("finish", 2.0)))


def test_summary_throughput_and_latency_hand_computed() -> None:
    s = summarize("sys", _events(), [])
    assert (s.system, s.num_requests, s.num_output_tokens) == ("sys", 3, 5)
    assert s.duration == pytest.approx(1.3)  # first arrival 0.0 -> last finish 1.3
    assert s.decode_throughput == pytest.approx(5 / 1.3)
    assert s.request_throughput == pytest.approx(3 / 1.3)
    assert s.ttft_mean == pytest.approx(0.35)  # ttfts 0.5 and 0.2
    assert s.ttft_p50 == pytest.approx(0.35)
    assert s.ttft_p99 == pytest.approx(0.2 + 0.3 * 0.99)
    assert s.tpot_mean == s.tpot_p99 == pytest.approx(0.8 / 3)
    assert s.e2e_mean == pytest.approx((1.3 + 0.2 + 0.1) / 3)


@pytest.mark.parametrize(
    ("ttft_target", "tpot_target", "num_good"),
    [
        (math.inf, math.inf, 2),  # every request with a token
        (0.4, math.inf, 1),  # a's TTFT 0.5 misses
        (1.0, 0.25, 1),  # a's TPOT 0.267 misses; b has no TPOT
        (1.0, 0.3, 2),
        (0.1, math.inf, 0),
    ],
)
def test_goodput_counts_requests_meeting_both_targets(
    ttft_target: float, tpot_target: float, num_good: int
) -> None:
    s = summarize("sys", _events(), [], ttft_target=ttft_target, tpot_target=tpot_target)
    assert s.goodput == pytest.approx(num_good / 1.3)


def test_iteration_shares_and_times() -> None:
    iterations = [
        _iteration(100, 140, 0.010),  # aligned
        _iteration(100, 150, 0.020, blocks={"decode": 7}),  # aligned (ratio exactly 1.5)
        _iteration(100, 151, 0.030, is_mixed=True, blocks={"decode": 9, "staging": 2}),
        _iteration(10, 4000, 0.040, blocks={"decode": 5}, instance="decode1"),
        _iteration(0, 0, 0.001, batch_size=0),  # idle step: not a decode iteration
    ]
    s = summarize("sys", _events(), iterations)
    assert s.aligned_iteration_share == pytest.approx(2 / 4)
    assert s.mixed_iteration_share == pytest.approx(1 / 5)
    assert s.forward_time_p50 == pytest.approx(0.020)
    assert s.forward_time_p99 == pytest.approx(0.030 + 0.010 * 0.96)
    assert s.schedule_time_p50 == pytest.approx(0.002)
    assert s.peak_blocks == {"decode": 9, "staging": 2}


def test_median_summary_of_repeated_runs_takes_each_figures_median() -> None:
    run = summarize("sys", _events(), [], tpot_target=math.inf)
    runs = [dataclasses.replace(run, decode_throughput=t, tpot_p99=p, ttft_p99=ttft)
            for t, p, ttft in ((5.0, 0.3, math.nan), (9.0, 0.1, 0.4), (6.0, 0.2, 0.2))]
    median = median_summary(runs)
    assert (median.decode_throughput, median.tpot_p99) == (6.0, 0.2)
    assert median.ttft_p99 == pytest.approx(0.3)  # NaN left out: the mean of 0.2 and 0.4
    assert median.tpot_slo == math.inf and median.num_output_tokens == run.num_output_tokens
    assert median_summary(runs[:1]) == runs[0]
    with pytest.raises(ValueError, match="one system"):
        median_summary([run, dataclasses.replace(run, system="other")])
    with pytest.raises(ValueError, match="one system"):
        median_summary([])


def test_empty_run_gives_nan_not_errors() -> None:
    s = summarize("sys", [], [])
    assert s.num_requests == 0 and s.duration == 0.0
    assert math.isnan(s.decode_throughput) and math.isnan(s.ttft_p99)
    assert math.isnan(s.aligned_iteration_share) and s.peak_blocks == {}


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([1.0, 2.0, 3.0, 4.0], 50, 2.5),
        ([1.0, 2.0, 3.0, 4.0], 99, 3.97),
        ([4.0, 1.0, 3.0, 2.0], 0, 1.0),
        ([4.0, 1.0, 3.0, 2.0], 100, 4.0),
        ([7.0], 99, 7.0),
    ],
)
def test_percentile_hand_computed(values: list[float], q: float, expected: float) -> None:
    assert percentile(values, q) == pytest.approx(expected)


def test_percentile_matches_numpy_linear() -> None:
    rng = random.Random(1)
    values = [rng.expovariate(3.0) for _ in range(257)]
    for q in (1, 25, 50, 90, 99, 99.9):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_empty_is_nan_and_bad_q_is_rejected() -> None:
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="q"):
        percentile([1.0], 101)


def test_hidden_transfer_share_counts_copy_time_under_forward_passes() -> None:
    from aserve.engine.sequence import IterationRecord, TransferRecord
    from bench.metrics import hidden_transfer_share

    def it(start: float, forward: float) -> IterationRecord:
        return IterationRecord("decode0", start, 4, 0, 10, 12, forward, 0.0, False, {})

    iterations = [it(0.0, 1.0), it(2.0, 1.0)]  # forwards run in [0, 1] and [2, 3]
    transfers = [TransferRecord("a", "host", "staging0", 2, 0.5, 1.5),   # 0.5 of 1.0 hidden
                 TransferRecord("b", "host", "staging0", 2, 2.0, 3.0),   # all hidden
                 TransferRecord("c", "staging0", "decode0", 2, 1.0, 2.0)]  # not a prefetch
    assert hidden_transfer_share(transfers, iterations) == 0.75
    assert hidden_transfer_share(transfers, [], "host", "staging") == 0.0
    assert math.isnan(hidden_transfer_share([], iterations))


def _paper_events() -> list[Event]:
    """p: 5 tokens with a 2 s wait in the pool between its 3rd and 4th; q: 3 tokens, steady."""
    return [
        *_log("p", ("arrival", 0.0), ("first_token", 1.0), ("token", 1.1), ("token", 1.2),
              ("token", 3.2), ("token", 3.3), ("finish", 3.3)),
        *_log("q", ("arrival", 0.5), ("first_token", 0.7), ("token", 0.75), ("token", 0.8),
              ("finish", 0.8)),
    ]


def test_tpot_is_last_minus_first_over_n_minus_one_including_pool_waits() -> None:
    by_id = {m.seq_id: m for m in request_metrics(_paper_events())}
    assert by_id["p"].tpot == pytest.approx((3.3 - 1.0) / 4)  # 0.575 s, the wait included
    assert by_id["q"].tpot == pytest.approx((0.8 - 0.7) / 2)
    s = summarize("sys", _paper_events(), [], tpot_target=math.inf)
    assert s.tpot_mean == pytest.approx((0.575 + 0.05) / 2)
    assert s.tpot_p50 == pytest.approx((0.575 + 0.05) / 2)
    assert s.tpot_p99 == pytest.approx(0.05 + 0.525 * 0.99)


@pytest.mark.parametrize(("slo", "good"), [(0.5, ["q"]), (0.6, ["p", "q"]), (0.01, [])])
def test_goodput_under_a_tpot_slo_counts_requests_and_their_tokens(
    slo: float, good: list[str]
) -> None:
    s = summarize("sys", _paper_events(), [], tpot_target=slo)
    tokens = {"p": 5, "q": 3}
    assert s.tpot_slo == slo
    assert s.goodput == pytest.approx(len(good) / 3.3)
    assert s.goodput_tokens == pytest.approx(sum(tokens[g] for g in good) / 3.3)
    assert s.slo_attainment == pytest.approx(len(good) / 2)


def test_the_default_slo_is_documented_and_applied() -> None:
    s = summarize("sys", _paper_events(), [])
    assert s.tpot_slo == DEFAULT_TPOT_SLO == 0.1
    assert s.goodput == pytest.approx(1 / 3.3)  # q (50 ms) meets 100 ms, p (575 ms) not


def test_iteration_latency_over_decode_iterations_only() -> None:
    iterations = [_iteration(10, 20, t) for t in (0.010, 0.020, 0.030, 0.040)]
    iterations.append(_iteration(0, 0, 0.500, batch_size=0))  # idle step: left out
    s = summarize("sys", [], iterations)
    assert s.iteration_latency_mean == pytest.approx(0.025)
    assert s.iteration_latency_p50 == pytest.approx(0.025)
    assert s.iteration_latency_p99 == pytest.approx(0.030 + 0.010 * 0.97)
    assert s.forward_time_p99 > 0.4  # the raw forward times keep the idle step
