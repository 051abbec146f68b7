"""Copies of KV blocks between stores, on copy streams with completion events on CUDA and as
plain memory copies on the CPU; `move` hands a sequence's KV from one store to another.

Mechanism only: which sequence moves where, and when, is decided by the caller.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor

import torch

from transport.cuda_copy import copy_cuda
from transport.handle import CopyHandle
from transport.kv import KVStore

logger = logging.getLogger(__name__)


class CopyEngine:
    """Copies KV blocks between two stores.

    On CUDA it owns a copy stream on each CUDA device of its (src device, dst device) pair,
    orders itself after the producer of the src blocks with an event, uses
    non_blocking copies from pinned memory, and returns a handle whose event marks completion.
    device->device goes over the peer link (a direct tensor copy between CUDA devices), and is
    staged through pinned host memory only when peer access is unavailable. On the CPU it is a
    plain copy. Build one engine per (src device, dst device) pair and reuse it.

    On CUDA every copy gathers the source rows with one `index_select` (a contiguous staging
    of the moved rows) and scatters them with one `index_copy_`: no Python loop over blocks or
    layers. On the CPU it copies each run of consecutive blocks as one slice (`block_runs`).
    """

    # TEST HOOK: when set, the next `copy` raises RuntimeError with this message before
    # writing anything into dst (on CUDA after gathering); the hook then clears itself.
    fail_next: str | None

    def __init__(self, src_device: torch.device | str, dst_device: torch.device | str) -> None:
        self.src_device = _normalize(torch.device(src_device))
        self.dst_device = _normalize(torch.device(dst_device))
        self.fail_next = None
        cuda_devices = {d for d in (self.src_device, self.dst_device) if d.type == "cuda"}
        self._streams: dict[torch.device, torch.cuda.Stream] = {
            device: torch.cuda.Stream(device=device) for device in sorted(cuda_devices, key=str)
        }
        self.has_peer_access = self._probe_peer_access()

    def __repr__(self) -> str:
        return f"CopyEngine({self.src_device} -> {self.dst_device})"

    @property
    def is_cuda(self) -> bool:
        """Whether either end is a CUDA device (copies are asynchronous)."""
        return bool(self._streams)

    def copy(
        self,
        src: KVStore,
        src_ids: list[int],
        dst: KVStore,
        dst_ids: list[int],
        producer: torch.cuda.Stream | None = None,
    ) -> CopyHandle:
        """Copies blocks `src_ids` of `src` into blocks `dst_ids` of `dst` (same length).

        The dst rows hold the data once the handle completes (`wait`, `done`, or `fence` for a
        stream consumer). On CUDA the copy starts after the work queued so far on `producer`,
        the stream that wrote src (default: the current stream of src's device; e.g. pass the
        prefetch engine's `stream(device)` for a staging buffer it filled).

        Raises:
            ValueError: mismatched stores, devices or id lists.
        """
        self._check(src, src_ids, dst, dst_ids)
        if not self.is_cuda:
            return self._copy_cpu(src, src_ids, dst, dst_ids)
        fault = self.raise_if_armed
        streams, has_peer_access = self._streams, self.has_peer_access
        return copy_cuda(streams, has_peer_access, fault, src, src_ids, dst, dst_ids, producer)

    def stream(self, device: torch.device | str) -> torch.cuda.Stream:
        """This engine's copy stream on `device` (KeyError when it has none there)."""
        return self._streams[_normalize(torch.device(device))]

    def raise_if_armed(self) -> None:
        """Fires the `fail_next` test hook."""
        if self.fail_next is not None:
            message, self.fail_next = self.fail_next, None
            raise RuntimeError(message)

    def _copy_cpu(
        self, src: KVStore, src_ids: list[int], dst: KVStore, dst_ids: list[int]
    ) -> CopyHandle:
        start_time = time.perf_counter()
        self.raise_if_armed()
        # NOTE: one slice copy per run of blocks consecutive in both stores (a block is one
        # contiguous row of every layer's K and V), straight from src to dst. The gather into
        # a fresh tensor and scatter out of it that CUDA uses is several times slower than
        # slices on a CPU, and every request's KV is copied three times on its way to decode.
        for src_start, dst_start, length in block_runs(src_ids, dst_ids):
            dst.tensor[dst_start:dst_start + length].copy_(
                src.tensor[src_start:src_start + length])
        handle = CopyHandle(len(src_ids) * src.geometry.bytes_per_block, len(src_ids), start_time)
        # NOTE: the copy is done, but callbacks still wait for `wait()`/`done()` so that callers
        # follow the same protocol on the CPU as on CUDA (and CPU tests exercise it).
        handle.end_time = time.perf_counter()
        return handle

    def _check(self, src: KVStore, src_ids: list[int], dst: KVStore, dst_ids: list[int]) -> None:
        if (src.device, dst.device) != (self.src_device, self.dst_device):
            raise ValueError(
                f"{self!r} cannot copy {src.name!r} ({src.device}) -> {dst.name!r} ({dst.device})"
            )
        if src.geometry != dst.geometry:
            raise ValueError(
                f"geometry of {src.name!r} ({src.geometry}) != geometry of {dst.name!r} "
                f"({dst.geometry})"
            )
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"len(src_ids) ({len(src_ids)}) != len(dst_ids) ({len(dst_ids)})")
        _check_ids("src_ids", src_ids, src)
        _check_ids("dst_ids", dst_ids, dst)
        if len(set(dst_ids)) != len(dst_ids):
            raise ValueError(f"dst_ids ({dst_ids}) must not repeat a block")

    def _probe_peer_access(self) -> bool:
        if self.src_device.type != "cuda" or self.dst_device.type != "cuda":
            return False
        if self.src_device == self.dst_device:
            return True
        src_index, dst_index = self.src_device.index, self.dst_device.index
        assert src_index is not None and dst_index is not None, "devices are normalized"
        has_peer_access = torch.cuda.can_device_access_peer(src_index, dst_index)
        if not has_peer_access:
            logger.warning("%r: no peer access, copies are staged through host memory", self)
        return has_peer_access


class Copier:
    """Runs KV copies between stores in worker threads, each thread's copies in order: one
    `CopyEngine` per (src device, dst device) pair, made on first use; copies touching a GPU
    on a copy thread of their own, CPU-to-CPU copies on `cpu_executor` when given.

    NOTE: give it the CPU device's forward thread. In a thread of its own a CPU copy's
    OpenMP team spins against the forward pass's on the same cores and slows every
    iteration many times over, and a CPU has no separate copy engine to overlap with.
    """

    def __init__(self, cpu_executor: Executor | None = None) -> None:
        self.copy_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aserve-copy")
        self.cpu_executor = cpu_executor or self.copy_executor
        self._engines: dict[tuple[str, str], CopyEngine] = {}

    def engine(self, src: KVStore, dst: KVStore) -> CopyEngine:
        """The copy engine from `src`'s device to `dst`'s (tests arm its `fail_next`)."""
        key = (str(src.device), str(dst.device))
        if key not in self._engines:
            self._engines[key] = CopyEngine(src.device, dst.device)
        return self._engines[key]

    def executor(self, src: KVStore, dst: KVStore) -> Executor:
        """The thread that runs copies from `src` to `dst`, in order."""
        if src.device.type == dst.device.type == "cpu":
            return self.cpu_executor
        return self.copy_executor

    def submit(self, src: KVStore, src_ids: list[int], dst: KVStore,
               dst_ids: list[int]) -> Future[None]:
        """Queues the copy of blocks `src_ids` of `src` into `dst_ids` of `dst`; the future
        is done once the rows are in `dst` (or holds the copy's error)."""
        engine = self.engine(src, dst)
        return self.executor(src, dst).submit(
            lambda: engine.copy(src, src_ids, dst, dst_ids).wait())

    def shutdown(self) -> None:
        """Stops the copy thread once its running copy ends (queued ones are cancelled)."""
        self.copy_executor.shutdown(wait=True, cancel_futures=True)


def move(
    seq_id: str,
    num_tokens: int,
    src: KVStore,
    dst: KVStore,
    engine: CopyEngine,
    producer: torch.cuda.Stream | None = None,
) -> CopyHandle | None:
    """Moves one sequence's KV (its first `num_tokens` tokens) from `src` to `dst`.

    Allocates the sequence in dst, copies its blocks, and frees its src blocks exactly once
    when the copy completes (the first `handle.wait()` or `handle.done()` that sees it).
    `producer` is passed to `CopyEngine.copy`.

    Returns:
        The copy's handle, or None (and nothing changed) when dst is full.
    Raises:
        KeyError: `seq_id` holds no blocks in src.
        ValueError: `seq_id` already holds blocks in dst, or its src blocks cover fewer than
            `num_tokens` tokens.
        Exception: whatever the copy raised; dst's new blocks are freed first and src keeps the
            sequence (nothing lost, nothing leaked).
    """
    src_ids = src.allocator.table(seq_id)
    num_blocks = src.allocator.blocks_for(num_tokens)
    if num_blocks > len(src_ids):
        raise ValueError(
            f"num_tokens ({num_tokens}) needs {num_blocks} blocks, {seq_id!r} holds "
            f"{len(src_ids)} in {src.name!r}"
        )
    dst_ids = dst.allocator.allocate(seq_id, num_tokens)
    if dst_ids is None:
        return None
    try:
        handle = engine.copy(src, src_ids[:num_blocks], dst, dst_ids, producer)
    except Exception:
        dst.allocator.free(seq_id)
        raise
    handle.add_done_callback(lambda: _free_source(src, seq_id))
    return handle


def block_runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """`(src start, dst start, length)` of the maximal runs of blocks that are consecutive in
    both id lists (aligned block for block), in order."""
    runs: list[tuple[int, int, int]] = []
    for src_id, dst_id in zip(src_ids, dst_ids):
        if runs:
            src_start, dst_start, length = runs[-1]
            if src_id == src_start + length and dst_id == dst_start + length:
                runs[-1] = (src_start, dst_start, length + 1)
                continue
        runs.append((src_id, dst_id, 1))
    return runs


def device_sync(device: torch.device | str) -> None:
    """Blocks the host until all work queued on `device` is done (no-op on the CPU). The only
    synchronisation helper in the project."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free_source(src: KVStore, seq_id: str) -> None:
    src.allocator.free(seq_id)


def _normalize(device: torch.device) -> torch.device:
    """Gives a bare `cuda` device its index, so that devices compare equal."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _check_ids(field_name: str, block_ids: list[int], store: KVStore) -> None:
    valid = store.allocator.block_ids  # the allocator says which ids the store may hold
    if block_ids and not (valid.start <= min(block_ids) and max(block_ids) < valid.stop):
        raise ValueError(
            f"{field_name} of {store.name!r} must lie in {valid.start}..{valid.stop - 1}, got "
            f"{min(block_ids)}..{max(block_ids)}"
        )
