"""Starvation control at the iteration boundary: a starving request in the candidate batch
is admitted before candidate requests that would otherwise keep the running batch fed."""

from __future__ import annotations

from scheduler import BoundaryView, PolicyConfig, SeqView, get_policy


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


def test_without_starvation_candidate_requests_go_first() -> None:
    for config, now in ((PolicyConfig(starvation_threshold=5.0), 3.0),
                        (PolicyConfig(starvation_threshold=None), 10.0)):
        plan = get_policy("aligned", config).plan_boundary(view(now=now))
        assert plan.admit_requests == ("m0",)


def test_starving_evicted_request_goes_before_closer_candidate_requests() -> None:
    running = (SeqView("r0", 40, 3, arrival_time=9.0, batch_id=1),)
    view = BoundaryView(
        running=running, free_blocks=8, block_size=16, max_batch_size=8,
        candidate_requests=(SeqView("near", 41, 3, arrival_time=9.5),
                            SeqView("evicted-long", 70, 5, arrival_time=0.0, batch_id=0)),
        candidate_batch=(), current_batch_id=1, now=10.0)
    plan = get_policy("aligned", PolicyConfig(starvation_threshold=5.0)).plan_boundary(view)
    assert plan.admit_requests[0] == "evicted-long"
