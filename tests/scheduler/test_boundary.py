"""Batch-level scheduling at iteration boundaries: victims, refill order, room, no thrash."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import BoundaryPlan, BoundaryView, PolicyConfig, SeqView, get_policy
from scheduler.aligned import STALL_STEPS, AlignedPolicy
from scheduler.batching import blocks_needed, blocks_to_admit

BLOCK_SIZE = 16  # tokens per block in every scenario here
CURRENT = 2  # current_batch_id in every scenario here


def seq(seq_id: str, length: int, num_blocks: int | None = None, arrival: float = 0.0,
        batch_id: int = CURRENT) -> SeqView:
    """A seq that, by default, needs one more block next step when length % 16 == 1."""
    if num_blocks is None:
        num_blocks = -(-(length - 1) // BLOCK_SIZE)
    return SeqView(seq_id, length, num_blocks, arrival, batch_id)


def view(running: list[SeqView], free_blocks: int, requests: tuple[SeqView, ...] = (),
         batch: tuple[SeqView, ...] = (), max_batch_size: int = 64) -> BoundaryView:
    return BoundaryView(tuple(running), free_blocks, BLOCK_SIZE, max_batch_size,
                        requests, batch, CURRENT, now=0.0)


def plan(policy_name: str, v: BoundaryView, max_spread: float | None = None) -> BoundaryPlan:
    return get_policy(policy_name, PolicyConfig(max_spread=max_spread)).plan_boundary(v)


def strict(policy_name: str, v: BoundaryView) -> BoundaryPlan:
    """The plan under strict alignment (max_spread 1.5)."""
    return plan(policy_name, v, max_spread=1.5)


ALIGNED = ["aligned-strict"]  # the fixed rules, with and without max_spread


@pytest.mark.parametrize("name", ALIGNED)
def test_victim_is_the_longest_running_seq(name: str) -> None:
    running = [seq("a", 33), seq("b", 65), seq("c", 49)]  # each needs 1 block
    assert plan(name, view(running, free_blocks=2)) == BoundaryPlan(evict=("b",))


@pytest.mark.parametrize("name", ALIGNED)
def test_victim_is_the_longest_of_the_old_batch_while_switching(name: str) -> None:
    running = [seq("old-a", 33, batch_id=1), seq("old-b", 49, batch_id=1), seq("new", 97)]
    assert plan(name, view(running, free_blocks=1)) == BoundaryPlan(evict=("old-b",))
    # strict: an old-batch victim matches neither batch, it goes back to the pool
    assert strict(name, view(running, free_blocks=1)) == BoundaryPlan(to_pool=("old-b",))


@pytest.mark.parametrize("name", ALIGNED)
def test_evicts_until_the_step_fits_old_batch_first(name: str) -> None:
    running = [seq("old", 17, batch_id=1), seq("n1", 33), seq("n2", 65), seq("n3", 49)]
    # need 4, free 0: old frees 1+1, n2 (longest new) frees 4+1.
    assert plan(name, view(running, free_blocks=0)).evict == ("old", "n2")
    assert strict(name, view(running, free_blocks=0)) == BoundaryPlan(evict=("n2",),
                                                                      to_pool=("old",))


@pytest.mark.parametrize("name", ALIGNED)
def test_refills_from_candidate_requests_before_candidate_batch(name: str) -> None:
    running = [seq("r", 20, 2)]  # no growth for two steps
    got = plan(name, view(running, 3, requests=(seq("x", 20, 2),), batch=(seq("y", 20, 2),)))
    assert got == BoundaryPlan(admit_requests=("x",))
    got = plan(name, view(running, 4, requests=(seq("x", 20, 2),), batch=(seq("y", 20, 2),)))
    assert got == BoundaryPlan(admit_requests=("x",), admit_batch=("y",))


@pytest.mark.parametrize("name", ALIGNED)
def test_candidate_requests_closest_to_the_current_batch_go_first(name: str) -> None:
    running = [seq("old", 135, 9, batch_id=1), seq("r1", 100, 7), seq("r2", 110, 7)]
    requests = (seq("far", 140, 9, arrival=0.0), seq("near", 120, 8, arrival=5.0))
    assert plan(name, view(running, 9, requests=requests)).admit_requests == ("near",)


@pytest.mark.parametrize("name", ALIGNED)
def test_strict_candidate_requests_never_widen_the_batch_beyond_max_spread(name: str) -> None:
    running = [seq("r1", 100, 7), seq("r2", 120, 8)]
    requests = (seq("short", 60, 4, arrival=0.0), seq("long", 160, 10, arrival=1.0),
                seq("fits", 140, 9, arrival=2.0))
    # room for all three; 60 and 160 would put the longest above 1.5x the shortest
    assert strict(name, view(running, 40, requests=requests)).admit_requests == ("fits",)
    assert len(plan(name, view(running, 40, requests=requests)).admit_requests) == 3


@pytest.mark.parametrize("name", ALIGNED)
def test_strict_switch_returns_the_old_batchs_stragglers_to_the_pool(name: str) -> None:
    running = [seq("old-long", 300, 19, batch_id=1), seq("old-near", 110, 7, batch_id=1)]
    requests = (seq("stale", 290, 19),)
    batch = (seq("b1", 100, 7, arrival=1.0), seq("b2", 120, 8, arrival=2.0))
    # two running seqs are at most drain_floor (0.1) of 64 slots: the old batch has drained
    # to its stragglers. 9 free blocks would take b1, but 100 next to 300 breaks 1.5x;
    # returning old-long (and the stale candidate request) frees 19 more: b1 and b2 enter
    got = strict(name, view(running, 9, requests=requests, batch=batch))
    assert got == BoundaryPlan(admit_batch=("b1", "b2"), to_pool=("old-long", "stale"))
    assert plan(name, view(running, 9, requests=requests, batch=batch)).to_pool == ()


@pytest.mark.parametrize("name", ALIGNED)
def test_strict_switch_waits_for_the_old_batch_to_drain(name: str) -> None:
    old = [seq(f"old{i}", 300 + i, 19, batch_id=1) for i in range(7)]  # 7 > 0.1 * 64 slots
    batch = (seq("b1", 100, 7, arrival=1.0), seq("b2", 280, 18, arrival=2.0))
    # b2 fits 1.5x with the old batch and enters; b1 waits, and nothing goes back
    assert strict(name, view(old, 40, batch=batch)) == BoundaryPlan(admit_batch=("b2",))
    assert strict(name, view(old, 40, batch=batch[:1])) == BoundaryPlan()
    # drained to 6: the stragglers go back to the pool and b1 enters
    got = strict(name, view(old[:6], 40, batch=batch[:1]))
    assert got == BoundaryPlan(admit_batch=("b1",), to_pool=tuple(s.seq_id for s in old[:6]))
    # a candidate batch wider than 1.5x enters in pieces, the first in arrival order first
    assert strict(name, view([], 40, batch=batch)) == BoundaryPlan(admit_batch=("b1",))


def padded_cost(lengths: object) -> float:
    """A step that reads every seq to the longest: grouping by length pays."""
    lengths = list(lengths)  # type: ignore[call-overload]
    return 1e-6 * (4096 + len(lengths) * max(lengths, default=0))


def test_aligned_keeps_the_batch_wide_where_a_step_costs_its_total_work() -> None:
    """Under a total-work (paged, split-K) cost a candidate that does not fit yet lets the
    next one in, where fcfs stops at it."""
    total_work = get_policy("aligned", PolicyConfig())  # the default: split-K's total work
    requests = (seq("late", 20, 2, arrival=2.0), seq("early", 300, 19, arrival=1.0))
    assert plan("fcfs", view([], 10, requests=requests)) == BoundaryPlan()
    assert total_work.plan_boundary(view([], 10, requests=requests)).admit_requests == (
        "late",)


def test_aligned_serves_arrival_order_where_a_step_costs_its_total_work() -> None:
    """Under a total-work cost grouping cannot pay: the victim is the latest arrival, not
    the longest seq nor the one with the most tokens generated, and an evicted seq goes
    back in before the fresh seqs that arrived after it (its wait stays bounded), while a
    seq that does not fit yet is passed."""
    def out(seq_view: SeqView, generated: int) -> SeqView:
        return replace(seq_view, num_output_tokens=generated)

    total_work = get_policy("aligned", PolicyConfig())
    running = [out(seq("long-early", 65, arrival=1.0), 2),
               out(seq("short-done", 17, arrival=2.0), 40),
               out(seq("mid-late", 33, arrival=3.0), 10)]  # each needs one more block
    assert total_work.plan_boundary(view(running, 2)).evict == ("mid-late",)
    running = [out(seq("r1", 100, 7), 20), out(seq("r2", 110, 7), 20)]  # no growth
    evicted = out(seq("evicted", 105, 7, arrival=1.0), 60)
    fresh = out(seq("fresh", 60, 4, arrival=2.0, batch_id=CURRENT + 1), 1)
    got = total_work.plan_boundary(view(running, 9, requests=(evicted,), batch=(fresh,)))
    assert got == BoundaryPlan(admit_requests=("evicted",))
    # the evicted seq does not fit yet: the fresh one passes it
    got = total_work.plan_boundary(view(running, 6, requests=(evicted,), batch=(fresh,)))
    assert got == BoundaryPlan(admit_batch=("fresh",))
    # with room for both, both go in
    got = total_work.plan_boundary(view(running, 40, requests=(evicted,), batch=(fresh,)))
    assert got == BoundaryPlan(admit_requests=("evicted",), admit_batch=("fresh",))


def test_aligned_admits_the_longest_waiting_first_in_a_backlogs_tail() -> None:
    """Where grouping cannot pay and nothing is pooled (a backlog's tail), the candidate
    that has waited longest for its next token goes first: the last batch's fresh seq,
    waiting since its prefill, before an evicted seq that arrived earlier but waits only
    since its eviction. While a seq is pooled, or once a request arrived after the fresh seq
    began to wait (a stream), arrival order: the evicted seq first."""
    def waiting(seq_view: SeqView, since: float, generated: int) -> SeqView:
        return replace(seq_view, waiting_since=since, num_output_tokens=generated)

    running = [seq("r1", 100, 7), seq("r2", 110, 7)]  # no growth next step
    evicted = waiting(seq("evicted", 105, 7, arrival=1.0), since=30.0, generated=60)
    fresh = waiting(seq("fresh", 60, 4, arrival=2.0, batch_id=CURRENT + 1), since=5.0,
                    generated=1)
    tail = get_policy("aligned", PolicyConfig())  # split-K's total work by default
    # room for one of them: the fresh seq, waiting since t=5, goes before the evicted one
    got = tail.plan_boundary(view(running, 9, requests=(evicted,), batch=(fresh,)))
    assert got == BoundaryPlan(admit_batch=("fresh",))
    backlog = get_policy("aligned", PolicyConfig())
    backlog.add(seq("pooled", 40, 3, arrival=3.0))
    got = backlog.plan_boundary(view(running, 9, requests=(evicted,), batch=(fresh,)))
    assert got == BoundaryPlan(admit_requests=("evicted",))
    # a stream: a request that arrived after the fresh seq began to wait is running
    stream = get_policy("aligned", PolicyConfig())
    later = [*running[:1], seq("r2", 110, 7, arrival=6.0)]
    got = stream.plan_boundary(view(later, 9, requests=(evicted,), batch=(fresh,)))
    assert got == BoundaryPlan(admit_requests=("evicted",))


def test_a_subclass_swaps_the_arrival_order_rule() -> None:
    """A research policy overrides ``arrival_victims``, ``arrival_admissions`` and
    ``arrival_admission_is_strict`` (as benchmarks/test_bench_split_k_rules.py does) and
    the boundary follows them."""
    class MostGeneratedFirst(AlignedPolicy):
        def arrival_victims(self, view: BoundaryView) -> list[SeqView]:
            return sorted(view.running, key=lambda s: -s.num_output_tokens)

        def arrival_admissions(self, view: BoundaryView) -> list[SeqView]:
            return sorted((*view.candidate_requests, *view.candidate_batch),
                          key=lambda s: s.num_output_tokens)

    def out(seq_view: SeqView, generated: int) -> SeqView:
        return replace(seq_view, num_output_tokens=generated)

    rule = MostGeneratedFirst(PolicyConfig())
    running = [out(seq("long-early", 65, arrival=1.0), 2),
               out(seq("short-done", 17, arrival=2.0), 40),
               out(seq("mid-late", 33, arrival=3.0), 10)]
    assert rule.plan_boundary(view(running, 2)).evict == ("short-done",)
    running = [out(seq("r1", 100, 7), 20), out(seq("r2", 110, 7), 20)]
    evicted = out(seq("evicted", 105, 7, arrival=1.0), 60)
    fresh = out(seq("fresh", 60, 4, arrival=2.0, batch_id=CURRENT + 1), 1)
    got = rule.plan_boundary(view(running, 9, requests=(evicted,), batch=(fresh,)))
    assert got == BoundaryPlan(admit_batch=("fresh",))
    # strict admission (fcfs's): the oldest, which does not fit yet, stops the rest
    strict_rule = type("Strict", (AlignedPolicy,), {"arrival_admission_is_strict": True})
    got = strict_rule(PolicyConfig()).plan_boundary(
        view(running, 6, requests=(evicted,), batch=(fresh,)))
    assert got == BoundaryPlan()


def test_aligned_admits_part_of_a_candidate_batch_only_where_the_part_pays() -> None:
    """A candidate batch of longer seqs, of which one fits beside a running batch of
    short ones: one step over both beats a step of each, yet that one seq would pad every
    short seq to its length until they are done, while in its own batch it costs little
    more. It waits for its batch; with room for the whole batch, the batch joins."""
    grouped = get_policy("aligned", PolicyConfig(), padded_cost)
    running = [seq(f"r{i}", 100, 7) for i in range(10)]
    batch = tuple(seq(f"c{i}", 300, 19, batch_id=CURRENT + 1) for i in range(4))
    assert grouped.plan_boundary(view(running, 32, batch=batch)) == BoundaryPlan()
    # the wait is bounded: past STALL_STEPS boundaries the part joins
    plans = [grouped.plan_boundary(view(running, 32, batch=batch))
             for _ in range(STALL_STEPS)]
    assert plans[-2] == BoundaryPlan() and plans[-1].admit_batch == ("c0",)
    whole = get_policy("aligned", PolicyConfig(), padded_cost).plan_boundary(
        view(running, 100, batch=batch))
    assert sorted(whole.admit_batch) == ["c0", "c1", "c2", "c3"]


def test_aligned_refills_closest_in_length_where_padding_costs() -> None:
    running = [seq("r1", 100, 7), seq("r2", 110, 7)]
    requests = (seq("long", 900, 57, arrival=0.0), seq("near", 120, 8, arrival=5.0))
    grouped = get_policy("aligned", PolicyConfig(), padded_cost)
    assert grouped.plan_boundary(view(running, 66, requests=requests)).admit_requests[0] == (
        "near")


def test_fcfs_refills_strictly_by_arrival() -> None:
    requests = (seq("late", 20, 2, arrival=2.0), seq("early", 300, 19, arrival=1.0))
    # "early" does not fit: strict FCFS admits nothing behind it; where padding makes
    # grouping pay, aligned skips it.
    assert plan("fcfs", view([], 10, requests=requests)) == BoundaryPlan()
    padded = get_policy("aligned", PolicyConfig(), padded_cost)
    assert padded.plan_boundary(view([], 10, requests=requests)).admit_requests == ("late",)


def test_fcfs_evicts_the_most_recent_arrival() -> None:
    running = [seq("first", 65, arrival=1.0), seq("last", 17, arrival=9.0),
               seq("mid", 33, arrival=5.0)]
    assert plan("fcfs", view(running, 2)).evict == ("last",)


@pytest.mark.parametrize("name", [*ALIGNED, "fcfs"])
@pytest.mark.parametrize("length", [33, 32])
def test_admitted_seq_fits_with_its_growth(name: str, length: int) -> None:
    # 2 blocks hold 32 tokens: length 33 needs a 3rd block next step, length 32 the step
    # after; admission reserves both steps, so neither enters with only 2 free blocks.
    candidate = seq("c", length, 2)
    assert plan(name, view([], 2, requests=(candidate,))) == BoundaryPlan()
    assert plan(name, view([], 3, requests=(candidate,))).admit_requests == ("c",)


@pytest.mark.parametrize("name", [*ALIGNED, "fcfs"])
def test_released_seq_frees_room_for_candidates(name: str) -> None:
    running = [seq("a", 20, 2), seq("b", 20, 2)]
    full = view(running, 0, requests=(seq("x", 20, 2),))
    assert plan(name, full) == BoundaryPlan()
    released = replace(full, running=(running[0],), free_blocks=2)  # "b" finished
    assert plan(name, released) == BoundaryPlan(admit_requests=("x",))


@pytest.mark.parametrize("name", [*ALIGNED, "fcfs"])
def test_full_batch_admits_nothing(name: str) -> None:
    got = plan(name, view([seq("a", 20, 2)], 100, requests=(seq("x", 20, 2),),
                          max_batch_size=1))
    assert got == BoundaryPlan()


def _seqs(prefix: str, batch_id: int) -> st.SearchStrategy[list[SeqView]]:
    one = st.tuples(st.integers(1, 200), st.integers(0, 1), st.floats(0, 50),
                    st.sampled_from([batch_id, CURRENT]))
    return st.lists(one, max_size=12).map(lambda xs: [
        SeqView(f"{prefix}{i}", n, max(0, -(-n // BLOCK_SIZE) - extra), t, b)
        for i, (n, extra, t, b) in enumerate(xs)])


@settings(max_examples=200, deadline=None)
@given(running=_seqs("r", 1), requests=_seqs("q", -1), batch=_seqs("b", 3),
       free_blocks=st.integers(0, 40), max_batch_size=st.integers(1, 20),
       name=st.sampled_from([*ALIGNED, "fcfs"]), max_spread=st.sampled_from([None, 1.5]))
def test_plans_fit_and_never_thrash(running: list[SeqView], requests: list[SeqView],
                                    batch: list[SeqView], free_blocks: int,
                                    max_batch_size: int, name: str,
                                    max_spread: float | None) -> None:
    v = view(running, free_blocks, tuple(requests), tuple(batch), max_batch_size)
    p = plan(name, v, max_spread)
    assert not (p.evict and (p.admit_requests or p.admit_batch)), "evict xor admit"
    assert set(p.evict) <= {s.seq_id for s in running}
    assert set(p.to_pool) <= {s.seq_id for s in running + requests}
    assert set(p.admit_requests) <= {s.seq_id for s in requests} - set(p.to_pool)
    assert set(p.admit_batch) <= {s.seq_id for s in batch}
    out = p.evict + p.to_pool
    kept = [s for s in running if s.seq_id not in out]
    admitted = [s for s in requests + batch if s.seq_id in p.admit_requests + p.admit_batch]
    freed = sum(s.num_blocks for s in running if s.seq_id in out)
    used = (sum(blocks_needed(s, BLOCK_SIZE) for s in kept)
            + sum(blocks_to_admit(s, BLOCK_SIZE) for s in admitted))
    growth = sum(blocks_needed(s, BLOCK_SIZE) for s in running)
    if growth <= free_blocks:
        assert not p.evict
        assert used <= free_blocks + freed and len(kept) + len(admitted) <= max(
            max_batch_size, len(running))
        if admitted:  # the very next boundary must not evict anyone
            after = [SeqView(s.seq_id, s.length + 1, max(s.num_blocks, -(-s.length // 16)),
                             s.arrival_time, s.batch_id) for s in kept + admitted]
            nxt = replace(v, running=tuple(after), free_blocks=free_blocks + freed - used,
                          candidate_requests=(), candidate_batch=())
            after_plan = plan(name, nxt, max_spread)
            assert after_plan.evict + after_plan.to_pool == ()
    else:
        assert out and used <= free_blocks + freed
