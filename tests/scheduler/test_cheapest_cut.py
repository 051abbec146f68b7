"""`aligned` takes its next batch as the first of the cheapest cut of the pool, in length
order, into batches: as wide as a step's fixed part makes pay, no wider than its padding
allows, whatever a request count would ask."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from scheduler import PolicyConfig, SeqView, get_policy
from scheduler.cost_model import CostModel, CostParams, get_geometry
from scheduler.hardware import get_hardware
from scheduler.step_time import run_times


def padded(overhead: float):  # type: ignore[no-untyped-def]
    """A step that pays ``overhead`` once and every seq's read to the batch's longest."""
    def step(lengths: Sequence[int]) -> float:
        return 1e-6 * (overhead + len(lengths) * max(lengths, default=0))
    return step


def pool(step_time, lengths: Sequence[int], min_requests: int = 8):  # type: ignore[no-untyped-def]
    policy = get_policy("aligned", PolicyConfig(starvation_threshold=None,
                                                min_requests=min_requests), step_time)
    for i, length in enumerate(lengths):
        policy.add(SeqView(f"s{i}", length, -(-length // 16), float(i)))
    return policy


def lengths_of(ids: Sequence[str], lengths: Sequence[int]) -> list[int]:
    return sorted(lengths[int(i[1:])] for i in ids)


def test_a_cheap_step_keeps_the_short_requests_apart_from_the_long() -> None:
    lengths = [40 + i for i in range(20)] + [300 + i for i in range(12)] + [900 + i
                                                                          for i in range(6)]
    for min_requests in (4, 32):  # 32: more than one length holds
        policy = pool(padded(200), lengths, min_requests)
        batch = policy.next_batch(250, 64, 0.0)  # the pool holds more than a batch
        assert lengths_of(batch, lengths) == lengths[:20]


def test_a_costly_fixed_part_widens_the_batch_as_far_as_it_pays() -> None:
    lengths = [40 + i for i in range(20)] + [60 + i for i in range(6)] + [900]
    narrow = pool(padded(0), lengths).next_batch(150, 64, 0.0)
    wide = pool(padded(1e6), lengths).next_batch(150, 64, 0.0)  # not the long one too
    assert len(narrow) < len(wide)
    assert max(lengths_of(wide, lengths)) < 900  # the long one still waits


def test_the_batch_stays_within_its_blocks_and_slots() -> None:
    lengths = [40] * 30
    batch = pool(padded(1e6), lengths).next_batch(40, 8, 0.0)
    assert 0 < len(batch) <= 8 and sum(-(-40 // 16) for _ in batch) <= 40


def test_where_a_spread_costs_nothing_the_oldest_go_first() -> None:
    lengths = [900, 40, 41, 42, 43, 44]
    policy = pool(lambda ls: 1e-6 * (4096 + sum(ls)), lengths)  # paged, split-K
    assert policy.next_batch(100, 2, 0.0) == ["s0", "s1"]


@pytest.mark.parametrize("kernel", ["padded", "split-k"])
def test_the_cut_with_the_models_vectorised_steps_is_the_cut_step_by_step(
        kernel: str) -> None:
    """With a cost model's own step time (``CostModel.iteration_time``) the cut prices a
    batch's every extension at once (``run_times``); it cuts where pricing each extension
    in turn cuts, over pools, rooms and slots of every size."""
    cost = CostModel(get_geometry("opt-1.3b"), get_hardware("h100"), CostParams(), kernel)
    fast = get_policy("aligned", PolicyConfig(), cost.iteration_time)
    slow = get_policy("aligned", PolicyConfig(), lambda ls: cost.iteration_time(ls))
    assert run_times(fast.step_time) is not None and run_times(slow.step_time) is None
    rng = random.Random(kernel)
    for _ in range(100):
        lengths = sorted(rng.randint(1, 4000) for _ in range(rng.randint(0, 100)))
        items = [(n, f"s{i}", -(-n // 16)) for i, n in enumerate(lengths)]
        room = (rng.randint(1, 4000), rng.randint(1, 120))
        assert fast._first_cut(items, *room) == slow._first_cut(items, *room)
