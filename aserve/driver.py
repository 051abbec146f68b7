"""The engine driver of the scheduling cores (aserve/cores.py): one asyncio actor per
instance carries out what its core asks for: forward passes in the device's worker thread,
KV moves on copy threads (`KVSpace`), while the event loop serves HTTP meanwhile. The
decisions are the cores'; the simulator (sim/drivers.py) drives the same cores.

An actor is woken by the `Wiring` (aserve/cores.py) when its core's state changes, and its
`run()` loop waits for that, never polls. The loop catches exceptions at its boundary: the
sequences it was processing fail with `finish_reason="error"`, their blocks are freed, and
the loop goes on.

KVSpace: every KV store of one engine, by name, and the awaitable copies that carry out the
cores' KV moves; the block bookkeeping is the torch-free BlockLedger's. Allocation and
freeing happen on the event-loop thread (allocators are not thread-safe); only the tensor
copy runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import torch

from aserve.config import EngineConfig
from aserve.core import SeqStatus, Sequence
from aserve.cores import (
    BatcherCore,
    BlockLedger,
    ColocatedCore,
    DecodeCore,
    Forward,
    Lifecycle,
    Move,
    Order,
    PrefillCore,
    Wiring,
)
from aserve.runner import PenaltySettings, PromptLogprobs, StepResult, WorkItem
from scheduler import ContinuousScheduler, Policy
from transport.copy import CopyEngine
from transport.kv import KVGeometry, KVStore

logger = logging.getLogger(__name__)


class Runner(Protocol):
    """What the actors need of a model runner (aserve.runner.ModelRunner, or a test's)."""

    async def execute(self, items: list[WorkItem], kv_cache: object) -> StepResult: ...

    def shutdown(self) -> None: ...


@dataclass
class EngineContext:
    """What the actors of one engine share: config, KV space, runners, policy, lifecycle,
    and the wiring that holds every actor."""

    config: EngineConfig
    kv: KVSpace
    runners: dict[str, Runner]  # by device string
    policy: Policy
    life: Lifecycle
    max_model_len: int
    clock: Callable[[], float] = time.perf_counter  # the engine driver's one clock
    wiring: Wiring = field(default_factory=Wiring)

    def now(self) -> float:
        return self.clock()


class Actor:
    """One instance's driver: its core, a wake-up event and a run loop; subclasses
    implement `act` (and `on_error`). With a `device`, the instance's KV store and model
    runner."""

    def __init__(self, ctx: EngineContext, core: Any, name: str,
                 device: str | None = None) -> None:
        self.ctx, self.core, self.name = ctx, core, name
        self.last_error: str | None = None
        self.num_errors = 0
        self._woken = asyncio.Event()
        self._stopping = False
        if device is not None:
            self.store = ctx.kv[name]
            self.runner = ctx.runners[device]

    def wake(self) -> None:
        """Its core's state changed: act on it once the current step is done."""
        self._woken.set()

    def stop(self) -> None:
        self._stopping = True
        self._woken.set()

    @property
    def has_work(self) -> bool:
        """Whether `act` has something to do now (else the loop waits to be woken)."""
        return False

    async def run(self) -> None:
        while True:
            if not self.has_work:
                await self._woken.wait()
            self._woken.clear()
            if self._stopping:
                return
            try:
                await self.act()
            except Exception as exc:  # the actor's boundary: log, fail what it held, go on
                self.on_error(self.record_error(exc))

    async def act(self) -> None:
        """Does what the core asks for now, awaiting forwards and copies."""

    def on_error(self, error: str) -> None:
        """Fails what the actor held when `act` raised."""

    def record_error(self, exc: BaseException) -> str:
        """Logs an exception caught at the actor's boundary and returns its message."""
        self.num_errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        logger.error("%s failed: %s\n%s", self.name, self.last_error,
                     "".join(traceback.format_exception(exc)))
        return self.last_error

    async def forward(self, step: Forward) -> StepResult:
        """Runs `step` on the device's worker thread (the engine's one way to compute)."""
        items = [work_item(s, self.ctx.kv.table(s), n)
                 for s, n in zip(step.seqs, step.num_new_tokens)]
        return await self.runner.execute(items, self.store.tensor)

    async def wait(self) -> None:
        """Nothing can run now: waits to be woken instead of spinning."""
        await self._woken.wait()

    async def carry_out(self, move: Move, landed: Callable[[Move, float], None],
                        failed: Callable[[Move, str, float], None] | None = None) -> None:
        """Copies one KV move, then tells its core: `landed(move, now)`, or on a failed
        copy `failed(move, error, now)` (by default that seq alone ends with an error)."""
        try:
            await self.ctx.kv.copy(move, self.ctx.clock)
        except Exception as exc:
            error = self.record_error(exc)
            if failed is None:
                self.ctx.life.fail_move(move, error, at=self.ctx.now())
            else:
                failed(move, error, self.ctx.now())
            return
        landed(move, self.ctx.now())

    async def carry_out_forks(self, forks: list[Move],
                              landed: Callable[[Move, float], None]) -> None:
        """Copies the KV of the samples forked from a prefill (n > 1), before anything else
        runs on this instance's store; a sample whose copy fails ends alone with an error."""
        for move in forks:
            await self.carry_out(move, landed)


class PrefillActor(Actor):
    """One prefill instance: packed prefill in the device's worker thread, then each
    request's KV is copied to the host pool (backpressure when full)."""

    def __init__(self, ctx: EngineContext, index: int) -> None:
        core = PrefillCore(index, ctx.kv, ctx.life, ctx.wiring,
                           ctx.config.scheduler.max_prefill_tokens)
        super().__init__(ctx, core, core.name, ctx.config.prefill_devices[index])

    @property
    def has_work(self) -> bool:
        return self.core.can_prefill

    async def act(self) -> None:
        if not await self.offload() or not self.core.can_prefill:
            return
        step = self.core.forward(self.ctx.now())
        if step is None:
            return
        try:
            result = await self.forward(step)
        except Exception as exc:
            self.core.fail(step, self.record_error(exc), self.ctx.now())
            return
        forks = self.core.finish(step, result.token_ids, result.logprobs, self.ctx.now(),
                                 result.forward_time)
        await self.carry_out_forks(forks, self.core.forked)
        await self.offload()

    async def offload(self) -> bool:
        """Copies prefilled KV to the host pool, in order; False while the pool is full."""
        while (move := self.core.next_offload(self.ctx.now())) is not None:
            await self.carry_out(move, self.core.landed)
        return not self.core.blocked

    def on_error(self, error: str) -> None:
        for seq in self.core.blocked:
            self.ctx.life.finish(seq, SeqStatus.FINISHED_ERROR, error, at=self.ctx.now())
        self.core.blocked.clear()


class BatcherActor(Actor):
    """The host pool and the batch generator: stages each order seq by seq into the decode
    instance's staging buffer on the prefill device (host -> device copies), then delivers
    it. The pool's bookkeeping is applied by the wiring as it happens, never queued behind
    a staging copy."""

    def __init__(self, ctx: EngineContext) -> None:
        sched = ctx.config.scheduler
        super().__init__(ctx, BatcherCore(ctx.policy, ctx.kv, ctx.life, ctx.wiring,
                                          ctx.config.cache.num_decode_blocks,
                                          sched.batch_kv_fraction, sched.max_batch_size),
                         "batcher")
        self.order: Order | None = None  # the order being staged

    async def act(self) -> None:
        while (order := self.core.next_order(self.ctx.now())) is not None:
            self.order = order
            while (move := self.core.next_move(order, self.ctx.now())) is not None:
                await self.carry_out(move, partial(self.core.landed, order))
            self.core.deliver(order, self.ctx.now())
            self.order = None

    def on_error(self, error: str) -> None:
        if self.order is not None:
            for seq in self.order.seqs:
                self.ctx.life.finish(seq, SeqStatus.FINISHED_ERROR, error, at=self.ctx.now())
            self.core.in_flight.discard(self.order.instance)
            self.order = None


class DecodeActor(Actor):
    """One decode instance. Each iteration: boundary (the policy's plan) -> its KV copies,
    awaited in order -> the forward in the device's worker thread -> one token per running
    request."""

    def __init__(self, ctx: EngineContext, index: int) -> None:
        core = DecodeCore(index, ctx.policy, ctx.kv, ctx.life, ctx.wiring,
                          ctx.config.scheduler.max_batch_size)
        super().__init__(ctx, core, core.name, ctx.config.decode_devices[index])

    @property
    def has_work(self) -> bool:
        return not self.core.is_idle

    async def act(self) -> None:
        if self.core.is_idle:
            return
        start = self.ctx.now()
        moves = self.core.boundary(start)
        schedule_time = self.ctx.now() - start  # the decision, not the copies carrying it out
        await self.carry_out_all(moves)
        step = self.core.forward(self.ctx.now())
        if isinstance(step, list):  # nothing could run: an eviction, or wait for a batch
            await self.carry_out_all(step)
            if not step:
                await self.wait()
            return
        result = await self.forward(step)
        self.core.finish(step, result.token_ids, result.logprobs, self.ctx.now(),
                         result.forward_time, schedule_time)

    async def carry_out_all(self, moves: list[Move]) -> None:
        """Copies `moves`, then the admissions the core asks for once they landed."""
        while True:
            for move in moves:
                await self.carry_out(move, self.core.landed, self.core.failed)
            moves = self.core.settled(self.ctx.now())
            if not moves:
                return

    def on_error(self, error: str) -> None:  # the running batch fails, the buffers survive
        self.core.fail(error, self.ctx.now())


class ContinuousActor(Actor):
    """One colocated instance (the `continuous` baseline, vLLM / Orca): prefill and decode
    on one device, chunked prefill mixed into decode steps, no pool."""

    def __init__(self, ctx: EngineContext, index: int) -> None:
        sched = ctx.config.scheduler
        core = ColocatedCore(index, ctx.kv, ctx.life, ContinuousScheduler(
            sched.max_prefill_tokens, sched.max_batch_size, ctx.kv.block_size))
        super().__init__(ctx, core, core.name, ctx.config.decode_devices[index])

    @property
    def has_work(self) -> bool:
        return not self.core.is_idle

    async def act(self) -> None:
        start = self.ctx.now()
        step = self.core.forward(start)
        if step is None:  # nothing fits: wait, never spin
            await self.wait()
            return
        schedule_time = self.ctx.now() - start
        result = await self.forward(step)
        forks = self.core.finish(step, result.token_ids, result.logprobs, self.ctx.now(),
                                 result.forward_time, schedule_time)
        await self.carry_out_forks(forks, self.core.forked)

    def on_error(self, error: str) -> None:  # the running batch fails, the queue survives
        self.core.fail(error, self.ctx.now())


def build_actors(ctx: EngineContext) -> list[Actor]:
    """The actors of `ctx`'s policy, wired to one another; returns them all."""
    num_prefill, num_decode = len(ctx.config.prefill_devices), len(ctx.config.decode_devices)
    if not ctx.policy.uses_pool:
        return ctx.wiring.connect(  # type: ignore[return-value]
            [], None, [ContinuousActor(ctx, j) for j in range(num_decode)])
    return ctx.wiring.connect(  # type: ignore[return-value]
        [PrefillActor(ctx, i) for i in range(num_prefill)], BatcherActor(ctx),
        [DecodeActor(ctx, j) for j in range(num_decode)])


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


def work_item(seq: Sequence, block_table: list[int], num_new_tokens: int) -> WorkItem:
    """The runner's view of computing `num_new_tokens` more of `seq`'s tokens."""
    start = seq.num_computed_tokens
    end = start + num_new_tokens
    params = seq.sampling
    return WorkItem(
        token_ids=seq.token_ids[start:end],
        start=start,
        block_table=block_table,
        do_sample=end == seq.num_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=params.seed,
        step=seq.num_output_tokens,
        penalties=PenaltySettings(
            params.presence_penalty, params.frequency_penalty, params.repetition_penalty,
            params.logit_bias, seq.token_ids, seq.num_prompt_tokens,
        ) if params.has_penalties else None,
        prompt_logprobs=PromptLogprobs(seq.token_ids, seq.num_prompt_tokens,
                                       seq.prompt_logprobs) if params.prompt_logprobs else None,
    )
