"""KVSpace: every KV store of one engine, by name, and the awaitable moves between them.

Allocation and freeing happen on the event-loop thread (allocators are not thread-safe);
only the tensor copy runs in the copy worker thread. Policy lives elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Mapping
from concurrent.futures import Executor, ThreadPoolExecutor

import torch

from aserve.config import EngineConfig
from aserve.core import Sequence, TransferRecord
from transport.copy import CopyEngine
from transport.kv import KVGeometry, KVStore

logger = logging.getLogger(__name__)
LOCATIONS = ("prefill", "staging", "host", "decode")


class KVSpace:
    """The engine's KV stores: `prefill{i}` scratch and `staging{j}` buffers on prefill
    devices, one `host` pool, and `decode{j}` caches. Staging buffer j serves decode
    instance j and sits on prefill device j mod P (the paper's candidate buffers)."""

    def __init__(self, config: EngineConfig, geometry: KVGeometry,
                 device_executors: Mapping[str, Executor] | None = None) -> None:
        cache = config.cache
        self.geometry = geometry
        pin = torch.cuda.is_available()
        self.stores: dict[str, KVStore] = {}
        for i, dev in enumerate(config.prefill_devices):
            self._add(KVStore(f"prefill{i}", geometry, cache.num_prefill_blocks,
                              torch.device(dev)))
        for j, dev in enumerate(config.decode_devices):
            self._add(KVStore(f"decode{j}", geometry, cache.num_decode_blocks, torch.device(dev)))
            staging_dev = config.prefill_devices[j % len(config.prefill_devices)]
            self._add(KVStore(f"staging{j}", geometry, max(cache.num_staging_blocks, 1),
                              torch.device(staging_dev)))
        self._add(KVStore.with_capacity_bytes("host", geometry, cache.host_pool_bytes,
                                              torch.device("cpu"), pin_memory=pin))
        self.copy_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aserve-copy")
        # NOTE: a copy between two CPU stores runs in the CPU device's own worker thread. In a
        # thread of its own its OpenMP team spun against the forward pass's on the same
        # cores (an opt-tiny iteration took ~160 ms instead of ~1 ms); a CPU has no separate
        # copy engine to overlap with anyway. Copies touching a GPU use the copy thread.
        self._cpu_executor = (device_executors or {}).get("cpu", self.copy_executor)
        self._engines: dict[tuple[str, str], CopyEngine] = {}
        self.transfers: list[TransferRecord] = []  # every completed move, for research

    def _add(self, store: KVStore) -> None:
        self.stores[store.name] = store

    def __getitem__(self, name: str) -> KVStore:
        return self.stores[name]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.geometry.block_size)

    def _engine(self, src: KVStore, dst: KVStore) -> CopyEngine:
        key = (str(src.device), str(dst.device))
        if key not in self._engines:
            self._engines[key] = CopyEngine(src.device, dst.device)
        return self._engines[key]

    def copy_engine(self, src_name: str, dst_name: str) -> CopyEngine:
        """The copy engine that moves KV from store `src_name` to store `dst_name` (tests
        reach its `fail_next` hook through this)."""
        return self._engine(self.stores[src_name], self.stores[dst_name])

    def executor(self, src_name: str, dst_name: str) -> Executor:
        """The thread that runs copies from store `src_name` to store `dst_name`, in order."""
        src, dst = self.stores[src_name], self.stores[dst_name]
        if src.device.type == dst.device.type == "cpu":
            return self._cpu_executor
        return self.copy_executor

    def allocate(self, seq: Sequence, name: str, num_tokens: int) -> bool:
        """Gives `seq` fresh blocks in store `name`; False (nothing changed) when full."""
        assert not seq.location, f"{seq.seq_id} already holds KV in {seq.location}"
        if self.stores[name].allocator.allocate(seq.seq_id, num_tokens) is None:
            return False
        seq.location = name
        return True

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Extends `seq`'s table in its store to cover `num_tokens`; False when full."""
        return self.stores[seq.location].allocator.grow(seq.seq_id, num_tokens) is not None

    def table(self, seq: Sequence) -> list[int]:
        return self.stores[seq.location].allocator.table(seq.seq_id)

    def release(self, seq: Sequence) -> None:
        """Frees every block `seq` holds, wherever it is; a no-op when it holds none."""
        if seq.location:
            self.stores[seq.location].allocator.free(seq.seq_id)
            seq.location = ""

    async def move(self, seq: Sequence, dst_name: str) -> bool:
        """Moves `seq`'s KV (its `num_computed_tokens` entries) to store `dst_name`.

        Returns False with nothing changed when the destination is full. If the copy fails
        the destination blocks are freed, the source keeps the KV, and the error propagates.
        """
        src, dst = self.stores[seq.location], self.stores[dst_name]
        if src is dst:
            return True
        num_tokens = max(seq.num_computed_tokens, 1)
        dst_ids = dst.allocator.allocate(seq.seq_id, num_tokens)
        if dst_ids is None:
            return False
        src_ids = src.allocator.table(seq.seq_id)[: len(dst_ids)]
        engine = self._engine(src, dst)
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        try:
            await loop.run_in_executor(self.executor(src.name, dst_name), _copy, engine, src,
                                       src_ids, dst, dst_ids)
        except BaseException:
            dst.allocator.free(seq.seq_id)
            raise
        src.allocator.free(seq.seq_id)
        self.transfers.append(TransferRecord(seq.seq_id, src.name, dst_name, len(dst_ids), start,
                                             time.perf_counter()))
        seq.location = dst_name
        return True

    async def fork(self, parent: Sequence, child: Sequence, num_tokens: int) -> bool:
        """Gives `child` blocks in `parent`'s store holding a copy of the parent's first
        `num_tokens` KV entries (n samples of one prompt share its prefill).

        Returns False with nothing changed when the store is full. If the copy fails the
        child's blocks are freed and the error propagates.
        """
        store = self.stores[parent.location]
        assert not child.location, f"{child.seq_id} already holds KV in {child.location}"
        dst_ids = store.allocator.allocate(child.seq_id, max(num_tokens, 1))
        if dst_ids is None:
            return False
        src_ids = store.allocator.table(parent.seq_id)[: len(dst_ids)]
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self.executor(store.name, store.name), _copy,
                                       self._engine(store, store), store, src_ids, store, dst_ids)
        except BaseException:
            store.allocator.free(child.seq_id)
            raise
        child.location = store.name
        return True

    def free_blocks(self, name: str) -> int:
        return self.stores[name].allocator.num_free

    def usage(self) -> dict[str, tuple[int, int]]:
        """(used, total) blocks per location kind, summed over instances."""
        out = {loc: (0, 0) for loc in LOCATIONS}
        for name, store in self.stores.items():
            kind = re.sub(r"\d+$", "", name)
            used, total = out[kind]
            out[kind] = (used + store.allocator.num_used, total + store.allocator.num_blocks)
        return out

    def blocks_used(self) -> dict[str, int]:
        return {loc: used for loc, (used, _) in self.usage().items()}

    def check_integrity(self) -> None:
        for store in self.stores.values():
            store.allocator.check_integrity()

    def shutdown(self) -> None:
        self.copy_executor.shutdown(wait=True, cancel_futures=True)


def _copy(engine: CopyEngine, src: KVStore, src_ids: list[int], dst: KVStore,
          dst_ids: list[int]) -> None:
    engine.copy(src, src_ids, dst, dst_ids).wait()
