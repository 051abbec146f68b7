"""The cost model's incremental decode step (``CostModel.decode_step``), which a cost-aware
policy grows one candidate at a time, gives the very numbers ``iteration_time`` gives."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.cost_model import KERNELS, CostModel, get_geometry
from scheduler.hardware import get_hardware


@settings(max_examples=150, deadline=None)
@given(lengths=st.lists(st.integers(1, 9000), max_size=80),
       joins=st.lists(st.tuples(st.integers(1, 9000), st.booleans()), min_size=1, max_size=12),
       kernel=st.sampled_from(KERNELS), heads=st.integers(1, 48), slots=st.integers(1, 160),
       model=st.sampled_from(["opt-125m", "opt-13b"]))
def test_a_growing_step_costs_what_iteration_time_costs(
        lengths: list[int], joins: list[tuple[int, bool]], kernel: str, heads: int,
        slots: int, model: str) -> None:
    """Exactly (==, not approximately): a policy decides on these numbers, and the two
    forms must decide alike. Head counts and worker counts that make waves end inside a
    seq, on its boundary, or span many seqs."""
    geometry = dataclasses.replace(get_geometry(model), num_heads=heads)
    hardware = dataclasses.replace(get_hardware("h100"), num_sms=slots)
    cost = CostModel(geometry, hardware, kernel=kernel)  # type: ignore[arg-type]
    step = cost.decode_step(lengths)
    assert step.time() == cost.iteration_time(lengths)
    for length, joins_now in joins:
        assert step.time_with(length) == cost.iteration_time([*lengths, length])
        if joins_now:
            step.add(length)
            lengths = [*lengths, length]
            assert step.time() == cost.iteration_time(lengths)
