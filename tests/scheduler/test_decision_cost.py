"""The cost-aware `aligned` grows the refilled batch's step one candidate at a time
(scheduler/step_time.py ``growing_step``, with the model's incremental form: what keeps a
decision cheap with a full batch and 10,000 pooled requests,
and decides as its definition does: a candidate joins unless ``waste`` of the batch with
it, recomputed whole, exceeds the batch's. The same plans, boundary after boundary."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from scheduler import BoundaryPlan, BoundaryView, PolicyConfig, SeqView, get_policy
from scheduler.aligned import AlignedPolicy
from scheduler.cost_model import KERNELS, GrowingDecodeStep
from scheduler.step_time import RecomputedStep, StepTime, growing_step
from sim import CostModel, get_geometry, get_hardware

BLOCK_SIZE = 16
NUM_BOUNDARIES = 300


def _seq(rng: random.Random, seq_id: str, now: float, batch_id: int = -1) -> SeqView:
    length = rng.randint(6000, 9000) if rng.random() < 0.1 else rng.randint(16, 2000)
    return SeqView(seq_id, length, -(-length // BLOCK_SIZE), now - rng.random(), batch_id,
                   waiting_since=now - rng.random() * 0.05)


def _boundaries(seed: int, max_batch: int) -> list[BoundaryView]:
    """Boundaries of a decode instance: from 1 running seq (of two batches) to a full
    batch, up to 8 candidate requests, often a candidate batch, room for a few."""
    rng = random.Random(seed)
    views = []
    for b in range(NUM_BOUNDARIES):
        now = 0.02 * b
        running = tuple(_seq(rng, f"b{b}r{i}", now, rng.choice((1, 2)))
                        for i in range(rng.randint(1, max_batch - 1)))
        requests = tuple(_seq(rng, f"b{b}q{i}", now) for i in range(rng.randint(0, 8)))
        batch = (tuple(_seq(rng, f"b{b}c{i}", now, 3)
                       for i in range(rng.randint(1, max_batch * 3 // 4)))
                 if rng.random() < 0.7 else ())
        views.append(BoundaryView(running, rng.randint(0, 4000), BLOCK_SIZE, max_batch,
                                  requests, batch, 2, now))
    return views


class ByDefinition(AlignedPolicy):
    """`aligned` with a refill weighed as documented: both batches costed whole."""

    def _lowers_waste(self, lengths: list[int], seq: SeqView) -> bool:
        return not lengths or not self._less_waste(self.waste(lengths),
                                                    self.waste([*lengths, seq.length]))


def _plans(policy: AlignedPolicy, step_time: StepTime,
           views: Sequence[BoundaryView]) -> list[BoundaryPlan]:
    policy.step_time = step_time
    return [policy.plan_boundary(view) for view in views]


@pytest.mark.parametrize("max_batch", [16, 256])
@pytest.mark.parametrize("kernel", KERNELS)
def test_plans_are_the_same_grown_or_recomputed(kernel: str, max_batch: int) -> None:
    model = CostModel(get_geometry("opt-13b"), get_hardware("h100"), kernel=kernel)  # type: ignore[arg-type]

    def whole_batches(lengths: Sequence[int]) -> float:  # no incremental form: recomputed
        return model.iteration_time(lengths)

    assert isinstance(growing_step(model.iteration_time, [5, 7]), GrowingDecodeStep)
    assert isinstance(growing_step(whole_batches, [5, 7]), RecomputedStep)
    views = _boundaries(len(kernel), max_batch)
    config = PolicyConfig(max_len=16384, starvation_threshold=None)
    grown = _plans(get_policy("aligned", config), model.iteration_time, views)
    assert grown == _plans(ByDefinition(config), whole_batches, views)
    assert grown == _plans(get_policy("aligned", config), whole_batches, views)
    # not vacuous: refills were weighed, some candidates joined and some were turned away
    admitted = sum(len(p.admit_requests) for p in grown)
    offered = sum(len(v.candidate_requests) for v, p in zip(views, grown)
                  if p.admit_requests or p.admit_batch)
    assert 0 < admitted < offered
