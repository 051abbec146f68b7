"""The cost-aware `aligned`'s latency guard (scheduler/aligned.py): admissions keep room
for the running seqs to grow, and an evicted seq does not wait behind a stream of better
fitting short ones beyond a bound counted in its instance's steps. Pure policy, virtual
time."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest

from scheduler import BoundaryView, PolicyConfig, SeqView, aligned, get_policy
from scheduler.batching import blocks_to_admit, growth

BLOCK_SIZE = 16
SHORT, LONG = 100, 4000  # tokens
MAX_BATCH = 12


def padded_step_time(lengths: Sequence[int]) -> float:
    """A padded backend's step in seconds: weights worth 4096 KV tokens plus batch x longest,
    at 1e-6 s per token (a long seq joining short ones costs its length in every row)."""
    return 1e-6 * (4096 + len(lengths) * max(lengths, default=0))


def short(seq_id: str, arrival: float) -> SeqView:
    return SeqView(seq_id, SHORT, -(-SHORT // BLOCK_SIZE), arrival, -1, waiting_since=arrival)


def _run_stream(num_steps: int) -> int | None:
    """Eight shorts decode; each step one finishes and a new short waits beside an evicted
    long seq in the candidate requests. Returns the step at which the long seq is
    admitted (None: never within ``num_steps``)."""
    policy = get_policy("aligned", PolicyConfig(starvation_threshold=None), padded_step_time)
    running = [SeqView(f"r{i}", SHORT, 7, 0.0, 1) for i in range(8)]
    evicted = SeqView("long", LONG, LONG // BLOCK_SIZE, 0.0, 1, waiting_since=0.0)
    requests = {"long": evicted}
    now = 0.0
    for step in range(1, num_steps + 1):
        now += padded_step_time([s.length for s in running])
        running.pop(0)  # one short finishes
        new = short(f"n{step}", now)
        requests[new.seq_id] = new
        view = BoundaryView(tuple(running), 10_000, BLOCK_SIZE, MAX_BATCH,
                            tuple(requests.values()), (), 1, now)
        plan = policy.plan_boundary(view)
        assert not plan.evict and not plan.to_pool
        for seq_id in plan.admit_requests:
            running.append(requests.pop(seq_id))
        if "long" in plan.admit_requests:
            return step
        running = [SeqView(s.seq_id, s.length + 1, s.num_blocks, s.arrival_time, 1)
                   for s in running]
    return None


def test_an_evicted_long_seq_waits_at_most_the_stall_bound_behind_short_ones() -> None:
    # Joining the shorts would raise their padded waste, so only the stall bound admits it:
    # after STALL_STEPS steps (each a short batch's step), at the next boundary.
    step = _run_stream(num_steps=10 * aligned.STALL_STEPS)
    assert step is not None
    assert aligned.STALL_STEPS <= step <= aligned.STALL_STEPS + 1


def test_without_the_stall_bound_the_stream_of_short_ones_keeps_it_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aligned, "STALL_STEPS", 10**9)
    assert _run_stream(num_steps=10 * 32) is None


def test_a_backlog_that_arrived_at_once_drains_in_the_cost_models_order() -> None:
    # Offline: nothing arrives after the long request, so however long it waits it is not
    # forced into the short ones' batch, which it would pad; it runs once they are served.
    policy = get_policy("aligned", PolicyConfig(starvation_threshold=None), padded_step_time)
    running = [SeqView(f"r{i}", SHORT, 7, 0.0, 1) for i in range(8)]
    waiting = [SeqView("long", LONG, LONG // BLOCK_SIZE, 0.0, -1, waiting_since=0.0),
               *(SeqView(f"s{i}", SHORT, 7, 0.0, -1, waiting_since=0.0)
                 for i in range(3 * aligned.STALL_STEPS))]
    requests = {s.seq_id: s for s in waiting}
    order, now = [], 0.0
    for _ in range(10 * aligned.STALL_STEPS):
        now += padded_step_time([s.length for s in running])
        if running:
            running.pop(0)  # one finishes
        view = BoundaryView(tuple(running), 10_000, BLOCK_SIZE, MAX_BATCH,
                            tuple(requests.values()), (), 1, now)
        plan = policy.plan_boundary(view)
        for seq_id in plan.admit_requests:
            running.append(requests.pop(seq_id))
            order.append(seq_id)
        running = [dataclasses.replace(s, length=s.length + 1) for s in running]
        if "long" in order:
            break
    assert order[-1] == "long" and len(order) == len(waiting)  # last, and not left out


def test_a_backlog_seq_the_running_batch_spans_joins_after_the_stall_bound() -> None:
    # Offline too: a seq no longer than the running batch's longest pads no one else, so
    # once stalled it joins rather than wait to make a last, small batch of its own.
    policy = get_policy("aligned", PolicyConfig(starvation_threshold=None), padded_step_time)
    running = tuple(SeqView(f"r{i}", LONG, LONG // BLOCK_SIZE, 0.0, 1) for i in range(8))
    middle = SeqView("middle", LONG // 2, LONG // 2 // BLOCK_SIZE, 0.0, -1, waiting_since=0.0)
    view = BoundaryView(running, 10_000, BLOCK_SIZE, MAX_BATCH, (middle,), (), 1, now=10.0)
    plans = [policy.plan_boundary(view) for _ in range(aligned.STALL_STEPS + 1)]
    assert not any(plan.admit_requests for plan in plans[:-1])  # it would raise the waste
    assert plans[-1].admit_requests == ("middle",)


def test_a_stalled_seq_that_does_not_fit_holds_every_other_admission_back() -> None:
    policy = get_policy("aligned", PolicyConfig(starvation_threshold=None), padded_step_time)
    running = tuple(SeqView(f"r{i}", SHORT, 7, 0.0, 1) for i in range(4))
    evicted = SeqView("long", LONG, LONG // BLOCK_SIZE, 0.0, 1, waiting_since=0.0)
    fresh = short("fresh", 9.0)
    view = BoundaryView(running, 100, BLOCK_SIZE, MAX_BATCH, (evicted, fresh),
                        (short("b0", 9.0),), 1, now=10.0)  # 100 blocks < the long seq's 251
    plans = [policy.plan_boundary(view) for _ in range(aligned.STALL_STEPS + 1)]
    assert plans[0].admit_requests == ("fresh",)  # before the long seq has stalled
    assert not plans[-1].admit_requests and not plans[-1].admit_batch


def test_admissions_leave_the_running_seqs_room_to_grow(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aligned, "HEADROOM_STEPS", 64)  # the default, pinned for this test
    running = tuple(SeqView(f"r{i}", SHORT, 7, 0.0, 1) for i in range(16))
    batch = tuple(SeqView(f"b{i}", SHORT, 7, 0.0, 2) for i in range(100))  # 700 blocks
    free = 600  # with the 112 held, 1/8 of the instance (89) is above the headroom
    view = BoundaryView(running, free, BLOCK_SIZE, 256, (), batch, 2, now=0.0)
    policies = {"aligned": get_policy("aligned", PolicyConfig(), padded_step_time),
                "aligned-loose": get_policy("aligned-loose", PolicyConfig())}
    # a long request in the pool: grouping pays there (where it cannot, `aligned` admits
    # as fcfs does, to the brim: tests/scheduler/test_boundary_starvation.py)
    policies["aligned"].add(SeqView("pooled", LONG, LONG // BLOCK_SIZE, 0.0))
    admitted = {name: policy.plan_boundary(view).admit_batch
                for name, policy in policies.items()}
    headroom = -(-len(running) * 64 // BLOCK_SIZE)  # 64 blocks
    used = {name: sum(blocks_to_admit(s, BLOCK_SIZE, 1) for s in batch if s.seq_id in ids)
            for name, ids in admitted.items()}
    reserve = growth(running, BLOCK_SIZE, 1)
    assert free - reserve - used["aligned-loose"] < 7  # the paper's rule fills to the brim
    assert free - reserve - used["aligned"] >= headroom  # aligned keeps the headroom
    assert len(admitted["aligned"]) >= len(admitted["aligned-loose"]) - headroom // 7 - 1


def test_headroom_is_at_most_a_share_of_a_small_instance(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aligned, "HEADROOM_STEPS", 64)
    running = tuple(SeqView(f"r{i}", SHORT, 7, 0.0, 1) for i in range(12))  # 84 held
    # 64 steps of growth would be 48 blocks, over half of this 114-block instance
    view = BoundaryView(running, 30, BLOCK_SIZE, 12, (), (), 1, now=0.0)
    assert aligned.with_headroom(view).free_blocks == 30 - int(0.125 * 114)
    assert aligned.with_headroom(BoundaryView((), 30, BLOCK_SIZE, 12, (), (), 1, 0.0)
                                     ).free_blocks == 30  # nothing running: nothing to grow
    monkeypatch.setattr(aligned, "HEADROOM_STEPS", 0)
    assert aligned.with_headroom(view) is view  # the default: no headroom


@pytest.mark.parametrize("waited_steps,admitted", [(1, False), (16, False), (17, True),
                                                   (aligned.HEADROOM_STEPS + 1, True)])
def test_the_headroom_shrinks_as_the_candidate_batch_waits(waited_steps: int,
                                                           admitted: bool) -> None:
    # 16 shorts hold 112 blocks and need none for two steps; the staged seq needs 63 of the
    # 80 free. The full headroom holds back 1/8 of the 192 blocks (24), leaving 56: it waits.
    # The headroom kept falls linearly to none after HEADROOM_STEPS boundaries of waiting
    # (under a padded cost, where grouping pays), so 63 fit once at most 17 of the 24 are
    # held back: past 16 of the 64 boundaries, however long each step took. (Where grouping
    # cannot pay, `aligned` keeps no headroom: it admits as fcfs does.) A drain floor of
    # every seq at hand lets the switch to the staged seq happen at once.
    running = tuple(SeqView(f"r{i}", SHORT, 7, 0.0, 1) for i in range(16))
    staged = SeqView("b", 1000, 63, 0.0, 2, waiting_since=0.0)
    view = BoundaryView(running, 80, BLOCK_SIZE, 256, (), (staged,), 2, now=1.0)
    assert blocks_to_admit(staged, BLOCK_SIZE, 1) == 63 and growth(running, BLOCK_SIZE, 1) == 0
    policy = get_policy("aligned", PolicyConfig(starvation_threshold=None, drain_floor=1.0),
                        padded_step_time)
    plans = [policy.plan_boundary(view) for _ in range(waited_steps)]
    assert not any(p.admit_batch for p in plans[:min(16, waited_steps - 1)])
    assert plans[-1].admit_batch == (("b",) if admitted else ())
    fifo = get_policy("aligned", PolicyConfig(starvation_threshold=None))  # total work
    assert fifo.plan_boundary(view).admit_batch == ("b",)
    loose = get_policy("aligned-loose", PolicyConfig(starvation_threshold=None))
    assert loose.plan_boundary(view).admit_batch == ("b",)  # no headroom at all


def test_a_running_batch_drains_before_an_unlike_batch_takes_its_place() -> None:
    # the drain floor is a share of the seqs at hand (16 running, 1 staged), not of the
    # 256 slots: 16 short seqs are not sent back to the pool for one long one
    running = tuple(SeqView(f"r{i}", SHORT, 7, 0.0, 1) for i in range(16))
    staged = SeqView("b", 1000, 63, 0.0, 2, waiting_since=0.0)
    view = BoundaryView(running, 80, BLOCK_SIZE, 256, (), (staged,), 2, now=1.0)
    policy = get_policy("aligned", PolicyConfig(starvation_threshold=None), padded_step_time)
    plans = [policy.plan_boundary(view) for _ in range(aligned.HEADROOM_STEPS + 1)]
    assert not any(p.admit_batch or p.to_pool for p in plans)
    drained = dataclasses.replace(view, running=(), free_blocks=80 + 16 * 7)
    assert policy.plan_boundary(drained).admit_batch == ("b",)
