"""Tests for bench/workloads.py: trace loading, sampling, rescaling and prompt ids."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from bench.workloads import (
    WorkloadRequest,
    azure,
    load_workload,
    parse_timestamp_ticks,
    scale_and_clip,
    sharegpt4,
    synthetic,
)


@pytest.mark.parametrize(
    ("name", "num_rows"), [("azure-code", 8819), ("azure-conv", 19366), ("sharegpt4", 30731)]
)
def test_trace_loads_every_row(name: str, num_rows: int) -> None:
    assert load_workload(name).num_requests == num_rows


@pytest.mark.parametrize(
    ("kind", "offsets"),
    [
        # 18:17:03.9799600, 18:17:04.0319600, 18:17:04.0781490, 18:17:04.1206440
        ("code", [0.0, 0.052, 0.098189, 0.140684]),
        # 18:15:46.6805900, 18:15:50.9951690, 18:15:51.2224670, 18:15:51.3910170
        ("conv", [0.0, 4.314579, 4.541877, 4.710427]),
    ],
)
def test_azure_arrivals_are_offsets_from_first_row(kind: str, offsets: list[float]) -> None:
    reqs = azure(kind).requests[:4]  # type: ignore[arg-type]
    assert [r.arrival_time for r in reqs] == pytest.approx(offsets, abs=1e-9)


def test_azure_rows_keep_trace_lengths() -> None:
    first, last = azure("code").requests[0], azure("code").requests[-1]
    assert (first.prompt_len, first.output_len) == (4808, 10)
    assert (last.prompt_len, last.output_len) == (549, 173)
    assert last.arrival_time == pytest.approx(3435.948056, abs=1e-6)  # 19:14:19.9280160


def test_timestamp_seventh_digit_is_one_tick() -> None:
    a = parse_timestamp_ticks("2023-11-16 18:17:03.9799600")
    assert parse_timestamp_ticks("2023-11-16 18:17:03.9799601") - a == 1


def test_timestamp_crosses_midnight() -> None:
    late = parse_timestamp_ticks("2023-11-16 23:59:59.9999999")
    assert parse_timestamp_ticks("2023-11-17 00:00:00.0000000") - late == 1


def test_timestamp_with_eight_digits_is_rejected() -> None:
    with pytest.raises(ValueError, match="fractional digits"):
        parse_timestamp_ticks("2023-11-16 18:17:03.97996001")


def test_azure_subset_is_a_seeded_contiguous_window() -> None:
    full = azure("conv").requests
    sub = azure("conv", num_requests=50, seed=7).requests
    start = next(i for i in range(len(full) - 49) if _lens(full[i : i + 50]) == _lens(sub))
    assert sub[0].arrival_time == 0.0
    expected = [r.arrival_time - full[start].arrival_time for r in full[start : start + 50]]
    assert [r.arrival_time for r in sub] == pytest.approx(expected, abs=1e-9)
    assert azure("conv", num_requests=50, seed=7) == azure("conv", num_requests=50, seed=7)
    assert _lens(azure("conv", num_requests=50, seed=8).requests) != _lens(sub)


def test_azure_rate_scale_compresses_time() -> None:
    base = azure("code", num_requests=20)
    fast = azure("code", num_requests=20, rate_scale=2.0)
    assert [r.arrival_time for r in fast.requests] == pytest.approx(
        [r.arrival_time / 2 for r in base.requests]
    )


def test_azure_offline_arrives_at_zero() -> None:
    assert {r.arrival_time for r in azure("code", num_requests=30, offline=True).requests} == {0.0}


def test_sharegpt4_sample_is_seeded_and_without_replacement() -> None:
    a = sharegpt4(num_requests=200, seed=1)
    assert a == sharegpt4(num_requests=200, seed=1)
    assert _lens(a.requests) != _lens(sharegpt4(num_requests=200, seed=2).requests)
    assert len({r.request_id for r in a.requests}) == 200
    assert {r.arrival_time for r in a.requests} == {0.0}


def test_sharegpt4_poisson_rate_is_close_to_asked() -> None:
    reqs = sharegpt4(num_requests=4000, rate=5.0).requests
    span = reqs[-1].arrival_time - reqs[0].arrival_time
    assert (len(reqs) - 1) / span == pytest.approx(5.0, rel=0.06)
    assert all(b.arrival_time >= a.arrival_time for a, b in zip(reqs, reqs[1:]))


def test_synthetic_short_share_is_exact() -> None:
    w = synthetic(200, short_ratio=0.9, short_range=(10, 20), long_range=(500, 600), seed=3)
    assert sum(r.prompt_len <= 20 for r in w.requests) == 180
    assert all(500 <= r.prompt_len <= 600 for r in w.requests if r.prompt_len > 20)


def test_synthetic_fixed_output_length() -> None:
    assert {r.output_len for r in synthetic(50, output_range=64).requests} == {64}


def test_length_scale_shrinks_lengths_keeping_at_least_one_token() -> None:
    full = synthetic(100, seed=5)
    small = synthetic(100, length_scale=0.01, seed=5)
    for a, b in zip(full.requests, small.requests):
        assert b.prompt_len == max(1, round(a.prompt_len * 0.01))
        assert b.output_len == max(1, round(a.output_len * 0.01))


def test_max_len_clips_prompt_plus_output() -> None:
    w = azure("conv", max_len=2048)
    assert max(r.prompt_len + r.output_len for r in w.requests) == 2048
    assert min(min(r.prompt_len, r.output_len) for r in w.requests) >= 1
    assert [r.output_len for r in w.requests] == [r.output_len for r in azure("conv").requests]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((7000, 10, 1.0, 2048), (2038, 10)),  # the prompt is trimmed first
        ((100, 3000, 1.0, 2048), (1, 2047)),  # then the output
        ((100, 50, 1.0, 2048), (100, 50)),  # fits: untouched
        ((3, 3, 0.1, None), (1, 1)),  # at least one token each
        ((1000, 200, 0.5, 400), (300, 100)),  # scaled, then clipped
    ],
)
def test_scale_and_clip(
    args: tuple[int, int, float, int | None], expected: tuple[int, int]
) -> None:
    assert scale_and_clip(*args) == expected


def test_with_rate_sets_mean_rate_and_keeps_order() -> None:
    w = azure("code", num_requests=100)
    fast = w.with_rate(10.0)
    times = [r.arrival_time for r in fast.requests]
    assert (len(times) - 1) / (times[-1] - times[0]) == pytest.approx(10.0)
    assert [r.request_id for r in fast.requests] == [r.request_id for r in w.requests]
    ratio = w.requests[50].arrival_time / fast.requests[50].arrival_time
    assert w.requests[99].arrival_time / fast.requests[99].arrival_time == pytest.approx(ratio)


def test_with_rate_on_offline_workload_is_rejected() -> None:
    with pytest.raises(ValueError, match="no arrival spread"):
        synthetic(10).with_rate(2.0)


def test_offline_zeroes_arrivals_and_keeps_lengths() -> None:
    w = synthetic(20, rate=3.0)
    off = w.offline()
    assert {r.arrival_time for r in off.requests} == {0.0}
    assert _lens(off.requests) == _lens(w.requests)


def test_prompt_token_ids_are_deterministic_and_avoid_specials() -> None:
    w = synthetic(5, seed=0)
    req = w.requests[0]
    ids = w.prompt_token_ids(req, vocab_size=50272, seed=11)
    assert ids == synthetic(5, seed=0).prompt_token_ids(req, vocab_size=50272, seed=11)
    assert len(ids) == req.prompt_len
    assert all(4 <= i < 50272 for i in ids)
    assert ids != w.prompt_token_ids(req, vocab_size=50272, seed=12)
    assert ids[:8] != w.prompt_token_ids(w.requests[1], vocab_size=50272, seed=11)[:8]


def test_prompt_token_ids_tiny_vocab_uses_only_non_special_ids() -> None:
    w = synthetic(3, short_range=(200, 200), long_range=(200, 200))
    assert set(w.prompt_token_ids(w.requests[0], vocab_size=6, seed=0)) == {4, 5}
    with pytest.raises(ValueError, match="vocab_size"):
        w.prompt_token_ids(w.requests[0], vocab_size=4, seed=0)


def test_unknown_workload_lists_names() -> None:
    with pytest.raises(ValueError, match="azure-code.*sharegpt4.*synthetic"):
        load_workload("sharegpt3")


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: synthetic(0), "num_requests"),
        (lambda: synthetic(5, short_ratio=1.5), "short_ratio"),
        (lambda: synthetic(5, output_range=(10, 5)), "output_range"),
        (lambda: synthetic(5, rate=0.0), "rate"),
        (lambda: synthetic(5, length_scale=0.0), "length_scale"),
        (lambda: synthetic(5, max_len=1), "max_len"),
        (lambda: azure("code", num_requests=9000), "num_requests"),
        (lambda: azure("code", rate_scale=-1.0), "rate_scale"),
        (lambda: azure("chat"), "kind"),  # type: ignore[arg-type]
    ],
)
def test_bad_arguments_name_the_field(build: Callable[[], object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        build()


def _lens(reqs: Sequence[WorkloadRequest]) -> list[tuple[int, int]]:
    return [(r.prompt_len, r.output_len) for r in reqs]
