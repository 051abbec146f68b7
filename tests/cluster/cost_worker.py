"""A NodeWorker runner whose steps cost the cost model's time without taking it: the front
end books that time on the simulator's device timeline (tests/cluster/test_differential.py),
as tests/cores/cost_runner.py does in one process."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from aserve.engine.config import ModelConfig
from aserve.engine.runner import StepResult, WorkItem
from models.opt import OPTConfig
from scheduler.cost_model import CostModel
from tests.cores.cost_runner import cost_step

T = TypeVar("T")


class RemoteCostRunner:
    """What a NodeWorker needs of a runner; a step returns token 0 for each sampled item
    and the cost model's seconds as its forward time, at once."""

    def __init__(self, config: ModelConfig, device: torch.device, block_size: int,
                 cost: CostModel) -> None:
        self.cost = cost
        self.model_config = OPTConfig.from_name(config.model)

    async def execute(self, items: list[WorkItem], kv_cache: object) -> StepResult:
        return cost_step(self.cost.iteration_time, items)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return fn(*args)

    def shutdown(self) -> None:
        pass
