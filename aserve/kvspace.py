"""KVSpace: every KV store of one engine, by name, and the awaitable copies that carry out
the cores' KV moves. Block bookkeeping is the torch-free BlockLedger's (aserve/cores/kv.py).

Allocation and freeing happen on the event-loop thread (allocators are not thread-safe);
only the tensor copy runs in a worker thread. Policy lives elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor

import torch

from aserve.config import EngineConfig
from aserve.cores import BlockLedger, Move
from transport.copy import CopyEngine
from transport.kv import KVGeometry, KVStore

logger = logging.getLogger(__name__)


class KVSpace(BlockLedger):
    """The engine's KV stores: `prefill{i}` scratch and `staging{j}` buffers on prefill
    devices, one `host` pool, and `decode{j}` caches. Staging buffer j serves decode
    instance j and sits on prefill device j mod P (the paper's candidate buffers)."""

    def __init__(self, config: EngineConfig, geometry: KVGeometry,
                 device_executors: Mapping[str, Executor] | None = None) -> None:
        cache = config.cache
        self.geometry = geometry
        pin = torch.cuda.is_available()
        stores = [KVStore(f"prefill{i}", geometry, cache.num_prefill_blocks, torch.device(dev))
                  for i, dev in enumerate(config.prefill_devices)]
        for j, dev in enumerate(config.decode_devices):
            stores.append(KVStore(f"decode{j}", geometry, cache.num_decode_blocks,
                                  torch.device(dev)))
            staging_dev = config.prefill_devices[j % len(config.prefill_devices)]
            stores.append(KVStore(f"staging{j}", geometry, max(cache.num_staging_blocks, 1),
                                  torch.device(staging_dev)))
        stores.append(KVStore.with_capacity_bytes("host", geometry, cache.host_pool_bytes,
                                                  torch.device("cpu"), pin_memory=pin))
        self.stores: dict[str, KVStore] = {store.name: store for store in stores}
        super().__init__({s.name: s.allocator for s in stores}, geometry.block_size)
        self.copy_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aserve-copy")
        # NOTE: a copy between two CPU stores runs in the CPU device's own worker thread. In a
        # thread of its own its OpenMP team spun against the forward pass's on the same
        # cores (an opt-tiny iteration took ~160 ms instead of ~1 ms); a CPU has no separate
        # copy engine to overlap with anyway. Copies touching a GPU use the copy thread.
        self._cpu_executor = (device_executors or {}).get("cpu", self.copy_executor)
        self._engines: dict[tuple[str, str], CopyEngine] = {}

    def __getitem__(self, name: str) -> KVStore:
        return self.stores[name]

    def copy_engine(self, src_name: str, dst_name: str) -> CopyEngine:
        """The copy engine that moves KV from store `src_name` to store `dst_name` (tests
        reach its `fail_next` hook through this)."""
        src, dst = self.stores[src_name], self.stores[dst_name]
        key = (str(src.device), str(dst.device))
        if key not in self._engines:
            self._engines[key] = CopyEngine(src.device, dst.device)
        return self._engines[key]

    def executor(self, src_name: str, dst_name: str) -> Executor:
        """The thread that runs copies from store `src_name` to store `dst_name`, in order."""
        src, dst = self.stores[src_name], self.stores[dst_name]
        if src.device.type == dst.device.type == "cpu":
            return self._cpu_executor
        return self.copy_executor

    async def copy(self, move: Move, clock: Callable[[], float]) -> None:
        """Copies a reserved move's KV and commits it. If the copy fails the error
        propagates with nothing committed (the caller cancels the move)."""
        src_ids, dst_ids = self.tables(move)
        start = clock()
        await asyncio.get_running_loop().run_in_executor(
            self.executor(move.src, move.dst), _copy, self.copy_engine(move.src, move.dst),
            self.stores[move.src], src_ids, self.stores[move.dst], dst_ids)
        self.commit(move, start, clock())

    def shutdown(self) -> None:
        self.copy_executor.shutdown(wait=True, cancel_futures=True)


def _copy(engine: CopyEngine, src: KVStore, src_ids: list[int], dst: KVStore,
          dst_ids: list[int]) -> None:
    engine.copy(src, src_ids, dst, dst_ids).wait()
