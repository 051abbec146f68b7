"""The bound of sim/bound.py: the search's schedule lies between the ideal floor and one
batch of everything, and its step times are the cost model's."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from bench.workloads import Workload, WorkloadRequest
from scheduler.cost_model import CostModel, get_geometry
from scheduler.hardware import get_hardware
from sim.bound import (
    ideal_decode_time,
    output_blind_decode_time,
    search_decode_time,
)


def model(kernel: str) -> CostModel:
    return CostModel(get_geometry("opt-125m"), get_hardware("cpu"), kernel=kernel)  # type: ignore[arg-type]


def workload() -> Workload:
    reqs = [WorkloadRequest(f"s{i}", 40 + 3 * i, 20 + i % 5, 0.0) for i in range(12)]
    reqs += [WorkloadRequest(f"l{i}", 900 + 7 * i, 25, 0.0) for i in range(3)]
    return Workload("mix", tuple(reqs))


def one_batch(w: Workload, cost: CostModel) -> float:
    """Every request in one static batch until the last finishes."""
    total, k = 0.0, 0
    while True:
        lengths = [r.prompt_len + 1 + k for r in w.requests if k < r.output_len - 1]
        if not lengths:
            return total
        total += cost.iteration_time(lengths)
        k += 1


@pytest.mark.parametrize("kernel", ["padded", "split-k"])
def test_step_times_are_the_cost_models(kernel: str) -> None:
    cost = model(kernel)
    for lengths in ([100] * 5 + [900], [33], [50, 60, 70] * 10):
        got = cost.decode_step_times(np.array([len(lengths)]), np.array([sum(lengths)]),
                                     np.array([max(lengths)]))[0]
        assert got == pytest.approx(cost.iteration_time(lengths), rel=1e-12)


def test_the_search_lies_between_the_floor_and_one_batch_of_everything() -> None:
    cost, w = model("padded"), workload()
    search = search_decode_time(w, cost, 10_000, 16, 64)
    assert ideal_decode_time(w, cost, 10_000, 16, 64) < search < one_batch(w, cost)
    # a decode instance too small for two long requests at once pays more
    assert search_decode_time(w, cost, 130, 16, 64) > search


def test_the_output_blind_search_knows_only_prompts_and_pays_for_it() -> None:
    cost, w = model("padded"), workload()
    search = search_decode_time(w, cost, 10_000, 16, 64)
    blind = output_blind_decode_time(w, cost, 10_000, 16, 64)
    assert search <= blind * (1 + 1e-12) and blind < one_batch(w, cost)  # sums may round
    # with every output alike, the outputs tell the search nothing
    same = Workload("same", tuple(dataclasses.replace(r, output_len=22) for r in w.requests))
    assert output_blind_decode_time(same, cost, 130, 16, 64) == pytest.approx(
        search_decode_time(same, cost, 130, 16, 64), rel=1e-12)
