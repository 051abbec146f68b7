"""The simulator's machinery: event ordering, KV block arithmetic, links and devices."""

from __future__ import annotations

from functools import partial

import pytest

from bench.sim.loop import FINISHED, Device, EventLoop, Link, Recorder, SimSeq, Stores


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


def test_blocks_follow_a_sequence_through_moves_and_release() -> None:
    stores = Stores(block_size=4)
    host, dev = stores.add("host", "host", 10), stores.add("decode0", "decode", 3)
    seq = SimSeq("a", prompt_len=9, output_len=2, arrival_time=0.0)
    assert stores.allocate(seq, host, 9) and seq.num_blocks == 3 and host.num_free == 7
    seq.num_computed = 9
    assert stores.move(seq, dev) == 3
    assert (host.num_free, dev.num_free, seq.location) == (10, 0, dev)
    assert not stores.grow(seq, 13)  # a 4th block does not fit
    assert stores.grow(seq, 12)  # still 3 blocks
    stores.release(seq)
    assert dev.num_free == 3 and seq.location is None
    assert stores.used() == {"prefill": 0, "staging": 0, "host": 0, "decode": 0}


def test_move_to_a_full_store_changes_nothing() -> None:
    stores = Stores(block_size=4)
    host, dev = stores.add("host", "host", 10), stores.add("decode0", "decode", 1)
    seq = SimSeq("a", 8, 1, 0.0)
    stores.allocate(seq, host, 8)
    seq.num_computed = 8
    assert stores.move(seq, dev) == 0
    assert seq.location is host and host.num_free == 8 and dev.num_free == 1


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
    assert device.busy_time == pytest.approx(3.0) and link.num_bytes == 100.0


def test_device_runs_steps_one_after_another() -> None:
    device = Device("gpu0")
    assert device.run(0.0, 2.0) == (0.0, 2.0)
    assert device.run(1.0, 1.0) == (2.0, 3.0)
    assert device.busy_time == pytest.approx(3.0)


def test_recorder_finishes_a_request_at_its_last_token() -> None:
    rec = Recorder()
    seq = SimSeq("a", prompt_len=5, output_len=2, arrival_time=0.0)
    assert not rec.token(seq, 1.0)
    assert rec.token(seq, 2.0)
    assert [(e.kind, e.time) for e in rec.events] == [
        ("first_token", 1.0), ("token", 2.0), ("finish", 2.0)]
    assert seq.num_tokens == 7 and seq.status == FINISHED and rec.num_finished == 1
