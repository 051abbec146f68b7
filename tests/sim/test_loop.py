"""The simulator's machinery: event ordering, device timelines, and KV copies on their links."""

from __future__ import annotations

from functools import partial

import pytest

from aserve.cores import Move
from aserve.engine.sequence import Request, SamplingParams, SeqState
from scheduler import PolicyConfig, get_policy
from sim import ClusterConfig, CostModel, get_geometry, get_hardware
from sim.drivers import SimContext
from sim.loop import Device, EventLoop


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


def test_a_settled_callback_runs_after_all_else_due_then() -> None:
    """What the callbacks due at its time schedule for that time runs first too; a later
    time's callbacks still wait for it."""
    loop = EventLoop()
    seen: list[str] = []

    def first() -> None:
        seen.append("a")
        loop.soon(partial(seen.append, "woken"))

    loop.at(1.0, partial(seen.append, "settled"), settled=True)
    loop.at(1.0, first)
    loop.at(1.0, partial(seen.append, "b"))
    loop.at(2.0, partial(seen.append, "later"))
    loop.run()
    assert seen == ["a", "b", "woken", "settled", "later"]


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


def transfer_context(hardware: str) -> tuple[SimContext, float]:
    """A simulated cluster (prefill on d0, decode on d1) and the seconds one KV block takes
    over its host link."""
    cluster = ClusterConfig.create(prefill_devices=("d0",), decode_devices=("d1",))
    cost = CostModel(get_geometry("opt-tiny"), get_hardware(hardware))
    ctx = SimContext(cluster, cost, get_policy("aligned", PolicyConfig.of(cluster.scheduler, 64)))
    return ctx, cost.kv_bytes(1, cluster.block_size) / cost.hardware.host_link_bandwidth


def move(src: str, dst: str, num_blocks: int) -> Move:
    request = Request(request_id="r", prompt_token_ids=(1,), sampling=SamplingParams(),
                      arrival_time=0.0)
    return Move(SeqState.from_request(request), src, dst, num_blocks)


def test_link_transfers_queue_behind_each_other() -> None:
    ctx, block = transfer_context("h100")
    assert ctx.transfer(move("host", "decode0", 10), 0.0) == pytest.approx(10 * block)
    # waits for the first
    assert ctx.transfer(move("host", "decode0", 5), 5 * block) == pytest.approx(15 * block)
    # the other direction is a link of its own; an idle link starts at once
    assert ctx.transfer(move("decode0", "host", 1), 0.0) == pytest.approx(block)
    assert ctx.transfer(move("host", "decode0", 1), 30 * block) == pytest.approx(31 * block)


def test_link_on_a_cpu_queues_copies_with_its_forwards() -> None:
    """On a CPU the engine copies in the device's thread: a copy waits for the forward
    booked before it, and the next forward waits for the copy."""
    ctx, block = transfer_context("cpu")
    device = ctx.devices["d1"]
    device.run(0.0, 1.0)
    assert ctx.transfer(move("host", "decode0", 10), 0.5) == pytest.approx(1.0 + 10 * block)
    assert device.run(0.0, 1.0) == pytest.approx((1.0 + 10 * block, 2.0 + 10 * block))
    assert device.busy_time == pytest.approx(2.0 + 10 * block)


def test_device_runs_steps_one_after_another() -> None:
    device = Device("gpu0")
    assert device.run(0.0, 2.0) == (0.0, 2.0)
    assert device.run(1.0, 1.0) == (2.0, 3.0)
    assert device.busy_time == pytest.approx(3.0)


def test_a_backlog_handed_over_at_once_does_not_nest_an_act_per_seq() -> None:
    """On one device the batcher hands a whole pooled backlog over to decode at once (one
    KV tensor: each move lands at once); the simulated batcher does not recurse per seq."""
    import sys

    from bench.workloads import synthetic
    from sim import ClusterConfig, simulate
    from tests.cores.test_differential import cost_model

    count = 400
    load = synthetic(count, short_ratio=1.0, short_range=(8, 16), long_range=(8, 16),
                     output_range=(2, 3), seed=0)
    cluster = ClusterConfig.create(num_decode_blocks=2 * count, num_prefill_blocks=64,
                                   num_staging_blocks=2 * count, num_host_blocks=4 * count,
                                   min_requests=count, max_batch_size=count)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(600)  # well under a frame or two per seq
    try:
        result = simulate(load, "aligned", cluster, cost_model("split-k"))
    finally:
        sys.setrecursionlimit(limit)
    assert result.num_finished == count
