"""Starvation control at the iteration boundary: a starving request in the candidate batch
is admitted before candidate requests that would otherwise keep the running batch fed."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from scheduler import BoundaryView, PolicyConfig, SeqView, get_policy
from tests.scheduler.test_policies import padded_step_time


def view(now: float | None) -> BoundaryView:
    running = (SeqView("r0", 40, 3, arrival_time=9.0, batch_id=1),)
    return BoundaryView(
        running=running, free_blocks=6, block_size=16, max_batch_size=8,
        candidate_requests=(SeqView("m0", 41, 3, arrival_time=9.5),),
        candidate_batch=(SeqView("long", 60, 4, arrival_time=0.0, batch_id=2),),
        current_batch_id=1, now=now)


def test_starving_candidate_batch_goes_before_candidate_requests() -> None:
    policy = get_policy("aligned", PolicyConfig(starvation_threshold=5.0))
    plan = policy.plan_boundary(view(now=10.0))
    assert plan.admit_batch == ("long",)
    assert plan.admit_requests == ()


def padded_step(lengths: Sequence[int]) -> float:
    """A padded backend's step, in steps of about a second (as ``unit_step_time``'s)."""
    return padded_step_time(lengths) / 4096


def test_without_starvation_candidate_requests_go_first_where_grouping_pays() -> None:
    for config, now in ((PolicyConfig(starvation_threshold=5.0), 3.0),
                        (PolicyConfig(starvation_threshold=None), 10.0)):
        plan = get_policy("aligned", config, padded_step).plan_boundary(view(now=now))
        assert plan.admit_requests == ("m0",)


def test_where_grouping_cannot_pay_the_wait_of_an_older_batch_is_bounded() -> None:
    """Under a total-work step cost (the default, as paged attention's on a CPU) the
    boundary admits in arrival order, past one that does not fit yet: the older candidate
    batch before the candidate request that arrived later, and the request only where the
    batch does not fit; once the batch starves it goes first too."""
    def fresher(free_blocks: int) -> BoundaryView:
        return dataclasses.replace(
            view(now=10.0), free_blocks=free_blocks,
            candidate_requests=(SeqView("m0", 41, 3, arrival_time=9.5, num_output_tokens=1),),
            candidate_batch=(SeqView("long", 60, 4, arrival_time=0.0, batch_id=2,
                                     num_output_tokens=2),))

    policy = get_policy("aligned", PolicyConfig(starvation_threshold=None))
    plan = policy.plan_boundary(fresher(6))
    assert plan.admit_batch == ("long",) and plan.admit_requests == ()  # 4 + 3 > 6 blocks
    plan = policy.plan_boundary(fresher(16))
    assert plan.admit_batch == ("long",) and plan.admit_requests == ("m0",)
    plan = policy.plan_boundary(fresher(3))
    assert plan.admit_batch == () and plan.admit_requests == ("m0",)
    plan = get_policy("aligned", PolicyConfig(starvation_threshold=5.0)).plan_boundary(
        fresher(6))
    assert plan.admit_batch == ("long",) and plan.admit_requests == ()


def test_starving_evicted_request_goes_before_closer_candidate_requests() -> None:
    running = (SeqView("r0", 40, 3, arrival_time=9.0, batch_id=1),)
    view = BoundaryView(
        running=running, free_blocks=8, block_size=16, max_batch_size=8,
        candidate_requests=(SeqView("near", 41, 3, arrival_time=9.5),
                            SeqView("evicted-long", 70, 5, arrival_time=0.0, batch_id=0)),
        candidate_batch=(), current_batch_id=1, now=10.0)
    plan = get_policy("aligned", PolicyConfig(starvation_threshold=5.0)).plan_boundary(view)
    assert plan.admit_requests[0] == "evicted-long"


def pooled(policy_name: str, arrivals: dict[str, float]):  # type: ignore[no-untyped-def]
    policy = get_policy(policy_name, PolicyConfig(starvation_threshold=5.0))
    for seq_id, at in arrivals.items():
        policy.add(SeqView(seq_id, 100, 7, arrival_time=at))
    return policy


def test_aligned_backlog_that_arrived_at_once_does_not_starve() -> None:
    """Offline: nothing arrived after the pooled requests, so none is overtaken by a later
    arrival however long it waits; the cost model orders the backlog (it drains)."""
    policy = pooled("aligned", {"a": 0.0, "b": 0.0, "c": 0.0})
    assert policy.starving_request(now=100.0) is None
    offline = BoundaryView(
        running=(SeqView("r0", 40, 3, arrival_time=0.0, batch_id=1),), free_blocks=6,
        block_size=16, max_batch_size=8,
        candidate_requests=(SeqView("m0", 41, 3, arrival_time=0.0),),
        candidate_batch=(SeqView("long", 60, 4, arrival_time=0.0, batch_id=2),),
        current_batch_id=1, now=100.0)
    assert not policy.is_starving(offline, offline.candidate_batch)


def test_aligned_request_overtaken_by_later_arrivals_starves() -> None:
    policy = pooled("aligned", {"old": 0.0, "new": 4.0})
    assert policy.starving_request(now=100.0) is None  # "new" came within the threshold
    policy.add(SeqView("newer", 100, 7, arrival_time=6.0))
    assert policy.starving_request(now=100.0) == "old"
    assert policy.starving_request(now=4.5) is None  # the clock never runs ahead of now


def test_fixed_rules_count_starvation_from_now() -> None:
    for name in ("aligned-strict", "aligned-loose"):
        assert pooled(name, {"a": 0.0, "b": 0.0}).starving_request(now=100.0) == "a"
