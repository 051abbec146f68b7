"""CostRunner: a ModelRunner stand-in for the engine driver whose steps take the cost
model's time (scheduler/cost_model.py) on a simulated device timeline and sample token 0. With a
virtual-clock event loop it lets the engine run the simulator's workload, decision for
decision, without a model."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

import torch

from aserve.engine.config import ModelConfig
from aserve.engine.runner import StepResult, WorkItem
from models.opt import OPTConfig
from scheduler.cost_model import CostModel
from sim.loop import Device


class CostRunner:
    """One device: forward passes booked on `device` for the cost model's time."""

    def __init__(self, cost: CostModel, device: Device, model: str) -> None:
        self.cost, self.device = cost, device
        self.step_time = cost.iteration_time  # the engine's policy decides with this model
        self.model_config = OPTConfig.from_name(model)
        self.executor = ThreadPoolExecutor(max_workers=1)

    @classmethod
    def factory(cls, cost: CostModel,
                devices: Mapping[str, Device]) -> Callable[..., CostRunner]:
        """`Engine(runner_factory=...)`: one CostRunner per device, on `devices[name]` (a
        SimContext's device timelines)."""
        def make(config: ModelConfig, dev: torch.device, block_size: int) -> CostRunner:
            return cls(cost, devices[str(dev)], config.model)
        return make

    async def execute(self, items: list[WorkItem], kv_cache: object) -> StepResult:
        """The step waits for the device like the simulator's (see `cost_step`)."""
        result = cost_step(self.duration, items)
        loop = asyncio.get_running_loop()
        end = self.device.run(loop.time(), result.forward_time)[1]
        await asyncio.sleep(end - loop.time())
        return result

    def duration(self, decode: list[int], chunks: list[tuple[int, int]]) -> float:
        """Seconds of a step over ``decode`` lengths and prefill ``chunks``."""
        return self.cost.iteration_time(decode, chunks)

    def shutdown(self) -> None:
        self.executor.shutdown()


def cost_step(duration: Callable[[list[int], list[tuple[int, int]]], float],
              items: list[WorkItem]) -> StepResult:
    """A step's outputs: decode items (one new token after a cached prefix) cost as decode,
    the others as prefill chunks, for ``duration(decode, chunks)`` seconds (a cost model's
    `iteration_time`); token 0 for each sampled item."""
    decode = [i.start + 1 for i in items if i.start > 0 and len(i.token_ids) == 1]
    chunks = [(i.start, len(i.token_ids)) for i in items
              if not (i.start > 0 and len(i.token_ids) == 1)]
    return StepResult([0 if i.do_sample else None for i in items], [None] * len(items),
                      duration(decode, chunks))
