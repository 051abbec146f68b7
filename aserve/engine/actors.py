"""The engine driver of the scheduling cores (aserve/cores): one asyncio actor per
instance carries out what its core asks for: forward passes in the device's worker thread,
KV moves on copy threads (`KVSpace`), while the event loop serves HTTP meanwhile. The
decisions are the cores'; the simulator (sim/drivers.py) drives the same cores.

An actor is woken by the `Wiring` (aserve/cores) when its core's state changes, and its
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
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Protocol

import torch

from aserve.cores import BlockLedger, Core, Forward, Lifecycle, Move, Wiring, kv_stores
from aserve.engine.config import EngineConfig
from aserve.engine.runner import PenaltySettings, PromptLogprobs, StepResult, WorkItem
from aserve.engine.sequence import SeqState
from models.cpu_kernels import advise_huge_pages
from scheduler import Policy
from transport.copy import Copier
from transport.kv import KVGeometry, KVStore, stores_for

logger = logging.getLogger(__name__)
# seconds an actor that caught an error and had nothing more to do stays failing (/health
# answers 503): long enough for a probe to see it; a step that goes through ends it sooner
ERROR_HOLD_S = 10.0


class Runner(Protocol):
    """What the actors need of a model runner (aserve.engine.runner.ModelRunner, or a test's)."""

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
    steps: dict[str, StepQueue] = field(init=False)  # by device string, over its runner

    def __post_init__(self) -> None:
        self.steps = {dev: StepQueue(runner, self.config.model.fuse_steps)
                      for dev, runner in self.runners.items()}


class Actor:
    """One instance's driver: its core (any kind: the loop is the same), a wake-up event,
    and with a `device` the instance's KV store and model runner. `run` does what the core
    asks for, awaiting forwards and copies, and waits to be woken when it asks for nothing."""

    def __init__(self, ctx: EngineContext, core: Core, device: str | None = None) -> None:
        self.ctx, self.core, self.name = ctx, core, core.name
        self.last_error: str | None = None
        self.num_errors = 0
        self.errors_by_kind: Counter[str] = Counter()  # exception type -> errors caught
        self.error_time: float | None = None  # the last error not yet followed by a success
        self._woken = asyncio.Event()
        self._stopping = False
        self._decided = 0.0  # seconds of decisions since the last forward (schedule_time)
        self._copies: set[asyncio.Task[None]] = set()  # the batcher's copies in flight
        # (start time, prompt tokens) of the forward running, while it includes a prefill
        self.prefill_running: tuple[float, int] | None = None
        self.device = device
        if device is not None:
            self.runner = ctx.runners[device]
            self.steps = ctx.steps[device]
            self.steps.users += 1

    def wake(self) -> None:
        """Its core's state changed: act on it once the current step is done."""
        self._woken.set()

    def stop(self) -> None:
        self._stopping = True
        self._woken.set()

    async def run(self) -> None:
        while not self._stopping:
            self._woken.clear()
            try:
                await self.act()
            except Exception as exc:  # the actor's boundary: log, fail what it held, go on
                self.core.fail(self.record_error(exc), self.ctx.clock())
        # the batcher's copies in flight finish before the engine shuts its copy threads down
        await asyncio.gather(*self._copies)

    async def act(self) -> None:
        """Does what the core asks for next (a forward, then the copies `finish` returns;
        or copies, one after another; the batcher's copies for different orders overlap,
        each copy thread running its own in turn), or waits to be woken when it asks for
        nothing."""
        start = self.ctx.clock()
        work = self.core.step(start)
        self._decided += self.ctx.clock() - start
        if work is None:
            await self._woken.wait()
            return
        if isinstance(work, Forward):
            result = await self.forward(work)
            work = self.core.finish(work, result.token_ids, result.logprobs, self.ctx.clock(),
                                    result.forward_time, self._decided, result.fused)
            self._decided = 0.0
        elif self.device is None:  # the batcher: orders overlap, as in the simulator
            for move in work:
                if move.handover:  # lands at once: nothing to overlap
                    await self.carry_out(move)
                    continue
                task = asyncio.create_task(self.carry_out(move))
                self._copies.add(task)
                task.add_done_callback(self._copies.discard)
            return
        for move in work:
            await self.carry_out(move)
        self._went_through(start)

    def _went_through(self, start: float) -> None:
        """A step or copy begun at `start` succeeded: an error caught before it is over."""
        if self.error_time is not None and self.error_time < start:
            self.error_time = None

    def is_failing(self, now: float, last_served: float) -> bool:
        """Whether an error caught at the boundary has been followed neither by a step of
        its own that went through nor by a request completing (at `last_served`); an actor
        left idle after it counts as recovered after ERROR_HOLD_S."""
        error_time = self.error_time
        return (error_time is not None and error_time > last_served
                and now - error_time < ERROR_HOLD_S)

    def record_error(self, exc: BaseException) -> str:
        """Logs an exception caught at the actor's boundary and returns its message."""
        self.num_errors += 1
        self.errors_by_kind[type(exc).__name__] += 1
        self.error_time = self.ctx.clock()
        self.last_error = f"{type(exc).__name__}: {exc}"
        logger.error("%s failed: %s", self.name, self.last_error, exc_info=exc)
        return self.last_error

    def running_prefill_pace(self) -> float | None:
        """Seconds per prompt token that the forward running has taken so far, while it
        includes a prefill; None otherwise."""
        if self.prefill_running is None:
            return None
        start, num_tokens = self.prefill_running
        return (self.ctx.clock() - start) / num_tokens

    async def forward(self, step: Forward) -> StepResult:
        """Runs `step` on the device's worker thread (the engine's one way to compute),
        fused with the steps other instances on the device submit meanwhile (`StepQueue`)."""
        items = [work_item(s, self.ctx.kv.table(s), n)
                 for s, n in zip(step.seqs, step.num_new_tokens)]
        num_prompt_tokens = sum(n for n in step.num_new_tokens if n > 1)
        self.prefill_running = (self.ctx.clock(), num_prompt_tokens) if num_prompt_tokens else None
        try:
            return await self.steps.execute(items, self.ctx.kv[self.name].tensor)
        finally:
            self.prefill_running = None

    async def carry_out(self, move: Move) -> None:
        """Copies one KV move, tells the core it `landed` (or `failed`), and wakes the actor:
        the batcher's core may order the next copy (an actor awaiting its copies in `act`
        steps again anyway)."""
        start = self.ctx.clock()
        try:
            await self.ctx.kv.copy(move, self.ctx.clock)
        except Exception as exc:
            self.core.failed(move, self.record_error(exc), self.ctx.clock())
        else:
            self.core.landed(move, self.ctx.clock())
            self._went_through(start)
        self.wake()


@dataclass(slots=True)
class _Waiting:
    items: list[WorkItem]
    kv_cache: object
    future: asyncio.Future[StepResult]


class StepQueue:
    """The steps waiting for one device's runner; with `fuse`, run as one forward per KV
    tensor.

    Instances sharing a device (a CPU engine's prefill and decode instances) submit steps
    one after the other; run apart, each reads every weight and pays the per-step overhead,
    and a decode step at a small batch is bound by that read. Steps waiting together over
    the same KV tensor run as one mixed step instead, as continuous batching mixes prefill
    chunks into decode iterations: each caller gets the outputs of its own items, and the
    whole forward's time with `fused` set. The instances' decisions are their own; only
    when their steps run is shared. A device with one instance runs its steps straight
    away. The simulator's devices queue steps the same way (sim/drivers.py `StepQueue`)."""

    def __init__(self, runner: Runner, fuse: bool) -> None:
        self.runner, self.fuse = runner, fuse
        self.users = 0  # the instances on the device (each actor counts itself in)
        self.waiting: list[_Waiting] = []
        self.task: asyncio.Task[None] | None = None
        self.num_fused = 0  # forwards begun over more than one instance's step

    async def execute(self, items: list[WorkItem], kv_cache: object) -> StepResult:
        if not self.fuse or self.users < 2:
            return await self.runner.execute(items, kv_cache)
        future = asyncio.get_running_loop().create_future()
        self.waiting.append(_Waiting(items, kv_cache, future))
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        try:
            while self.waiting:
                # the instances the last step woke submit their next one before it starts
                await asyncio.sleep(0)
                kv_cache = self.waiting[0].kv_cache
                steps = [w for w in self.waiting  # not those whose caller was cancelled
                         if w.kv_cache is kv_cache and not w.future.done()]
                self.waiting = [w for w in self.waiting if w.kv_cache is not kv_cache]
                if steps:
                    await self._run(steps, kv_cache)
        except asyncio.CancelledError:  # the loop shuts down: so do the steps waiting
            for w in self.waiting:
                w.future.cancel()
            self.waiting = []
            raise

    async def _run(self, steps: list[_Waiting], kv_cache: object) -> None:
        fused = len(steps) > 1
        self.num_fused += fused
        try:
            result = await self.runner.execute([i for w in steps for i in w.items], kv_cache)
        except BaseException as exc:  # each instance in the forward meets its error
            cancelled = isinstance(exc, asyncio.CancelledError)
            for w in steps:
                if not w.future.done():
                    w.future.cancel() if cancelled else w.future.set_exception(exc)
            if cancelled:
                raise
            return
        start = 0
        for w in steps:
            end = start + len(w.items)
            if not w.future.done():
                w.future.set_result(StepResult(result.token_ids[start:end],
                                               result.logprobs[start:end],
                                               result.forward_time, fused))
            start = end


class KVSpace(BlockLedger):
    """The engine's KV stores, as `kv_stores` lays them out plus the `host` pool (pinned
    when CUDA exists), with their tensors, and the copies between them."""

    def __init__(self, config: EngineConfig, geometry: KVGeometry,
                 device_executors: Mapping[str, Executor] | None = None) -> None:
        layout = kv_stores(config.prefill_devices, config.decode_devices, config.cache,
                           geometry.blocks_in(config.cache.host_pool_bytes, "host_pool_gb"))
        super().__init__(layout, geometry.block_size, config.cache.share_kv_memory,
                         config.trace_limit)
        # NOTE: a step reads most of its cache; its blocks are untouched yet (torch.empty),
        # so they fault in as huge pages on the CPU: fewer TLB misses per step
        self.stores = stores_for(layout, self.allocators, geometry, torch.cuda.is_available(),
                                 advise=advise_huge_pages)
        # copies between CPU stores run in the CPU device's forward thread (`Copier`)
        self.copier = Copier((device_executors or {}).get("cpu"))

    def __getitem__(self, name: str) -> KVStore:
        return self.stores[name]

    async def copy(self, move: Move, clock: Callable[[], float]) -> None:
        """Copies a reserved move's KV and commits it. If the copy fails the error
        propagates with nothing committed (the caller cancels the move)."""
        if move.handover:  # one KV tensor: the table changes stores, nothing to copy
            now = clock()
            self.commit(move, now, now)
            return
        src_ids, dst_ids = self.tables(move)
        start = clock()
        await asyncio.wrap_future(self.copier.submit(self.stores[move.src], src_ids,
                                                     self.stores[move.dst], dst_ids))
        self.commit(move, start, clock())


def work_item(seq: SeqState, block_table: list[int], num_new_tokens: int) -> WorkItem:
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
        logprobs=params.logprobs,
    )
