"""Continuous batching with chunked prefill: budgets, blocks and preemption order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import ContinuousScheduler, ContinuousSeq

BLOCK_SIZE = 4  # tokens per block in every scenario here


def decode(seq_id: str, num_tokens: int, arrival: float) -> ContinuousSeq:
    """A decoding seq whose last token is not computed yet and whose blocks are full."""
    computed = num_tokens - 1
    return ContinuousSeq(seq_id, num_tokens, computed, -(-computed // BLOCK_SIZE), arrival)


def prompt(seq_id: str, num_tokens: int, arrival: float) -> ContinuousSeq:
    return ContinuousSeq(seq_id, num_tokens, 0, 0, arrival)


def test_decode_gets_one_token_and_prefill_is_chunked_by_the_budget() -> None:
    sched = ContinuousScheduler(max_num_tokens=10, max_batch_size=8, block_size=BLOCK_SIZE)
    got = sched.plan([decode("d", 9, 0.0)], [prompt("p", 30, 1.0), prompt("q", 5, 2.0)], 100)
    assert got.preempt == ()
    assert got.scheduled == (("d", 1), ("p", 9))


def test_running_chunked_prefill_continues_before_waiting_seqs() -> None:
    sched = ContinuousScheduler(max_num_tokens=8, max_batch_size=8, block_size=BLOCK_SIZE)
    half = ContinuousSeq("half", 20, 8, 2, 0.0)
    got = sched.plan([half], [prompt("p", 4, 1.0)], 100)
    assert got.scheduled == (("half", 8),)


def test_preempts_the_most_recent_arrival_when_blocks_run_out() -> None:
    sched = ContinuousScheduler(max_num_tokens=64, max_batch_size=8, block_size=BLOCK_SIZE)
    running = [decode("late", 9, 5.0), decode("early", 9, 1.0), decode("mid", 9, 3.0)]
    got = sched.plan(running, [prompt("p", 4, 6.0)], free_blocks=1)
    # each needs one new block; "late" is preempted, its 2 blocks serve "mid".
    assert got.preempt == ("late",)
    assert got.scheduled == (("early", 1), ("mid", 1))


def test_preempts_itself_when_it_is_the_latest() -> None:
    sched = ContinuousScheduler(max_num_tokens=64, max_batch_size=8, block_size=BLOCK_SIZE)
    got = sched.plan([decode("only", 9, 0.0)], [], free_blocks=0)
    assert got.preempt == ("only",) and got.scheduled == ()


def test_waiting_seqs_are_fcfs_and_stop_at_the_first_that_does_not_fit() -> None:
    sched = ContinuousScheduler(max_num_tokens=100, max_batch_size=8, block_size=BLOCK_SIZE)
    waiting = [prompt("small-late", 4, 2.0), prompt("big-early", 40, 1.0)]
    assert sched.plan([], waiting, free_blocks=5).scheduled == ()
    assert sched.plan([], waiting, free_blocks=11).scheduled == (("big-early", 40),
                                                                 ("small-late", 4))


@pytest.mark.parametrize("field", ["max_num_tokens", "max_batch_size", "block_size"])
def test_bad_limits_name_the_field(field: str) -> None:
    kwargs = {"max_num_tokens": 8, "max_batch_size": 8, "block_size": 4, field: 0}
    with pytest.raises(ValueError, match=field):
        ContinuousScheduler(**kwargs)


def _seq(prefix: str) -> st.SearchStrategy[ContinuousSeq]:
    return st.builds(
        lambda i, n, done, t: ContinuousSeq(f"{prefix}{i}", n, min(done, n - 1),
                                            -(-min(done, n - 1) // BLOCK_SIZE), t),
        st.integers(0, 10**6), st.integers(1, 60), st.integers(0, 60), st.floats(0, 10))


@settings(max_examples=200, deadline=None)
@given(running=st.lists(_seq("r"), max_size=10, unique_by=lambda s: s.seq_id),
       waiting=st.lists(_seq("w"), max_size=10, unique_by=lambda s: s.seq_id),
       free_blocks=st.integers(0, 40), max_num_tokens=st.integers(1, 80),
       max_batch_size=st.integers(1, 12))
def test_plan_never_over_commits(running: list[ContinuousSeq], waiting: list[ContinuousSeq],
                                 free_blocks: int, max_num_tokens: int,
                                 max_batch_size: int) -> None:
    sched = ContinuousScheduler(max_num_tokens, max_batch_size, BLOCK_SIZE)
    plan = sched.plan(running, waiting, free_blocks)
    seqs = {s.seq_id: s for s in running + waiting}
    scheduled_ids = [seq_id for seq_id, _ in plan.scheduled]
    assert sum(n for _, n in plan.scheduled) <= max_num_tokens
    assert len(plan.scheduled) <= max_batch_size
    assert set(plan.preempt) <= {s.seq_id for s in running}
    assert not set(plan.preempt) & set(scheduled_ids)
    freed = sum(seqs[i].num_blocks for i in plan.preempt)
    needed = 0
    for seq_id, n in plan.scheduled:
        s = seqs[seq_id]
        assert 1 <= n <= s.num_tokens - s.num_computed_tokens
        needed += max(0, -(-(s.num_computed_tokens + n) // BLOCK_SIZE) - s.num_blocks)
    assert needed <= free_blocks + freed
    is_running = [i.startswith("r") for i in scheduled_ids]
    assert is_running == sorted(is_running, reverse=True), "running seqs come first"
    if plan.preempt:
        kept = [s.arrival_time for s in running if s.seq_id not in plan.preempt]
        gone = [seqs[i].arrival_time for i in plan.preempt]
        assert all(k <= g for k in kept for g in gone), "only the latest arrivals go"
