"""NodeWorker: one instance's side on its node, run as a Ray actor there: the model runner
of its device and the KV stores placed on the node with it. It computes the forwards and
moves the blocks its driver (aserve/cluster/driver.py) asks for; it decides nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from aserve.engine.config import ModelConfig
from aserve.engine.runner import ModelRunner, StepResult, WorkItem
from aserve.engine.sequence import IterationRecord
from aserve.engine.step_probe import probe
from transport.kv import KVGeometry
from transport.remote import NodeStores

RunnerFactory = Callable[[ModelConfig, torch.device, int], Any]


class NodeWorker:
    """The runner of one device and the stores beside it. Methods are coroutines (a Ray
    async actor): a forward runs in the runner's worker thread, and so do the node's copies,
    as the single-process engine runs a CPU's copies between its forwards."""

    def __init__(self, model: ModelConfig, device: str, block_size: int, seed: int,
                 num_threads: int | None, runner_factory: RunnerFactory | None = None) -> None:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        torch.manual_seed(seed)  # sampled requests without a seed draw from this RNG
        self.runner = (runner_factory or ModelRunner)(model, torch.device(device), block_size)
        self.stores: NodeStores | None = None

    async def model_config(self) -> Any:
        return self.runner.model_config

    async def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()  # type: ignore[no-any-return]

    async def open_stores(self, layout: Mapping[str, tuple[str, int]], geometry: KVGeometry,
                          share_memory: bool) -> None:
        """Allocates the KV tensors of `layout` (the stores placed here); a restarted worker
        is given them again, empty, as its ledger's tables are then."""
        self.stores = await self.runner.call(NodeStores, layout, geometry, share_memory)

    def _stores(self) -> NodeStores:
        if self.stores is None:
            raise RuntimeError("the worker's KV stores are not open (open_stores)")
        return self.stores

    async def execute(self, store: str, items: list[WorkItem]
                      ) -> tuple[StepResult, list[list[float] | None]]:
        """One step against `store`'s tensor; with it, the prompt logprobs the step wrote
        (the items' lists are copies here: the driver writes them back)."""
        result = await self.runner.execute(items, self._stores()[store].tensor)
        return result, [i.prompt_logprobs.out if i.prompt_logprobs else None for i in items]

    async def probe(self, store: str, num_blocks: int, block_size: int, max_len: int,
                    max_batch_size: int) -> list[IterationRecord]:
        """The engine's start-up probe of decode steps, on this device."""
        return await self.runner.call(probe, self.runner, self._stores()[store].tensor,  # type: ignore[no-any-return]
                                      num_blocks, block_size, max_len, max_batch_size)

    async def export_blocks(self, store: str, block_ids: list[int]) -> np.ndarray:
        return await self.runner.call(self._stores().export_blocks, store, block_ids)  # type: ignore[no-any-return]

    async def import_blocks(self, store: str, block_ids: list[int], rows: np.ndarray) -> int:
        return await self.runner.call(self._stores().import_blocks, store, block_ids, rows)  # type: ignore[no-any-return]

    async def copy_blocks(self, src: str, src_ids: list[int], dst: str,
                          dst_ids: list[int]) -> None:
        await self.runner.call(self._stores().copy_blocks, src, src_ids, dst, dst_ids)

    async def ping(self) -> bool:
        return True

    async def shutdown(self) -> None:
        self.runner.shutdown()
