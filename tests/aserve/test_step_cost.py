"""The engine's step-cost model (aserve/step_cost.py): `aligned` gets sim/cost.py's model of
the engine's geometry and attention backend, fitted to a start-up probe of synthetic decode
steps; the other policies are not probed."""

from __future__ import annotations

import pytest

from aserve import Engine
from aserve.step_cost import PROBE_BATCH, EngineStepCost
from scheduler.cost import RecomputedStep, growing_step
from tests.conftest import make_config


@pytest.mark.parametrize("attention,kernel", [("paged", "split-k"), ("padded", "padded")])
async def test_aligned_decides_with_a_model_fitted_to_a_startup_probe(attention: str,
                                                                      kernel: str) -> None:
    async with Engine(make_config(policy="aligned", attention=attention)) as engine:
        step_time = engine.ctx.policy.step_time  # type: ignore[union-attr]
        assert isinstance(step_time, EngineStepCost)
        assert step_time.kernel == kernel and step_time.num_fits == 1
        assert step_time([100] * PROBE_BATCH) > 0
        # the refill loop's incremental form: the very numbers of the fitted model
        grown = growing_step(step_time, [100] * PROBE_BATCH)
        assert not isinstance(grown, RecomputedStep)
        assert grown.time_with(700) == step_time([100] * PROBE_BATCH + [700])
        assert not any(engine.ctx.kv.blocks_used().values())  # type: ignore[union-attr]


async def test_fcfs_is_not_probed() -> None:
    async with Engine(make_config(policy="fcfs")) as engine:
        step_time = engine.ctx.policy.step_time  # type: ignore[union-attr]
        assert isinstance(step_time, EngineStepCost) and step_time.num_fits == 0
