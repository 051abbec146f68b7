"""The simulator's machinery: event ordering, links and devices."""

from __future__ import annotations

from functools import partial

import pytest

from sim.loop import Device, EventLoop, Link


def test_events_run_in_time_order_and_ties_in_scheduling_order() -> None:
    loop = EventLoop()
    seen: list[tuple[float, str]] = []
    for time, name in ((2.0, "c"), (1.0, "a"), (2.0, "d"), (1.0, "b"), (0.5, "first")):
        loop.at(time, partial(seen.append, (time, name)))
    loop.run()
    assert seen == [(0.5, "first"), (1.0, "a"), (1.0, "b"), (2.0, "c"), (2.0, "d")]
    assert loop.now == 2.0 and loop.num_events == 5


def test_soon_runs_after_what_is_already_due_now() -> None:
    loop = EventLoop()
    seen: list[str] = []
    def first() -> None:
        seen.append("a")
        loop.soon(partial(seen.append, "soon"))

    loop.at(1.0, first)
    loop.at(1.0, partial(seen.append, "b"))
    loop.run()
    assert seen == ["a", "b", "soon"]


def test_scheduling_in_the_past_is_refused() -> None:
    loop = EventLoop()
    loop.at(3.0, lambda: None)
    loop.run()
    with pytest.raises(ValueError, match="time"):
        loop.at(2.0, lambda: None)


def test_run_until_leaves_later_events() -> None:
    loop = EventLoop()
    seen: list[int] = []
    for t in (1, 2, 3):
        loop.at(float(t), partial(seen.append, t))
    loop.run(until=2.0)
    assert seen == [1, 2] and len(loop) == 1


def test_link_transfers_queue_behind_each_other() -> None:
    link = Link("pcie", bandwidth=100.0)
    assert link.transfer(0.0, 100.0) == pytest.approx(1.0)
    assert link.transfer(0.5, 50.0) == pytest.approx(1.5)  # waits for the first
    assert link.transfer(3.0, 100.0) == pytest.approx(4.0)  # idle link starts at once


def test_link_on_a_device_queues_copies_with_its_forwards() -> None:
    """On a CPU the engine copies in the device's thread: a copy waits for the forward
    booked before it, and the next forward waits for the copy."""
    device = Device("cpu")
    link = Link("cpu.d2h", bandwidth=100.0, device=device)
    device.run(0.0, 1.0)
    assert link.transfer(0.5, 100.0) == pytest.approx(2.0)
    assert device.run(0.0, 1.0) == pytest.approx((2.0, 3.0))
    assert device.busy_time == pytest.approx(3.0)


def test_device_runs_steps_one_after_another() -> None:
    device = Device("gpu0")
    assert device.run(0.0, 2.0) == (0.0, 2.0)
    assert device.run(1.0, 1.0) == (2.0, 3.0)
    assert device.busy_time == pytest.approx(3.0)
