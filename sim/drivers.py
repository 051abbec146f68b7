"""The simulator's driver of the scheduling cores (aserve/cores.py): each instance is a thin
shell that runs its core's forward passes for the cost model's time on a simulated device
and its KV moves over simulated links with their queues. The decisions are the cores'.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from aserve.core import SeqStatus
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
from scheduler import ContinuousScheduler, Policy
from sim.cluster import ClusterConfig
from sim.cost import CostModel
from sim.loop import Callback, Device, EventLoop, Link, SimActor
from transport.blocks import BlockAllocator


@dataclass
class SimContext:
    """What the simulated instances of one run share."""

    config: ClusterConfig
    cost: CostModel
    policy: Policy
    record_tokens: bool = True
    loop: EventLoop = field(default_factory=EventLoop)
    devices: dict[str, Device] = field(default_factory=dict)
    links: dict[str, Link] = field(default_factory=dict)
    policy_time: float = 0.0  # real seconds spent deciding (inside the cores), not simulated
    wiring: Wiring = field(default_factory=Wiring)
    kv: BlockLedger = field(init=False)
    life: Lifecycle = field(init=False)

    def __post_init__(self) -> None:
        cfg = self.config
        sizes = {"host": cfg.num_host_blocks}
        if self.policy.uses_pool:
            sizes |= {f"prefill{i}": cfg.num_prefill_blocks
                      for i in range(len(cfg.prefill_devices))}
            for j in range(len(cfg.decode_devices)):
                sizes |= {f"decode{j}": cfg.num_decode_blocks,
                          f"staging{j}": max(cfg.num_staging_blocks, 1)}
        else:
            sizes |= {f"decode{k}": cfg.num_decode_blocks
                      for k in range(len(cfg.colocated_devices))}
        self.kv = BlockLedger({name: BlockAllocator(n, cfg.block_size, name)
                               for name, n in sizes.items()}, cfg.block_size)
        self.life = Lifecycle(self.kv, eos_token_id=-1, record_tokens=self.record_tokens)

    def decide(self, call: Callable, *args: object) -> object:  # type: ignore[type-arg]
        """Runs one core decision, adding its real time to `policy_time`."""
        began = time.perf_counter()
        result = call(*args)
        self.policy_time += time.perf_counter() - began
        return result

    def device(self, name: str) -> Device:
        if name not in self.devices:
            self.devices[name] = Device(name)
        return self.devices[name]

    def link(self, name: str, bandwidth: float, device: str = "") -> Link:
        """The link `name`; on a CPU (`not hardware.is_gpu`) its copies occupy `device`'s
        compute timeline, as the engine runs CPU-to-CPU copies in the device's thread."""
        if name not in self.links:
            on = self.device(device) if device and not self.cost.hardware.is_gpu else None
            self.links[name] = Link(name, bandwidth, on)
        return self.links[name]

    def host_link(self, device: str, direction: str) -> Link:
        """`direction` is "h2d" or "d2h"; one PCIe link per device."""
        return self.link(f"{device}.{direction}", self.cost.hardware.host_link_bandwidth, device)

    def peer_link(self, src: str, dst: str) -> Link:
        """Device-to-device copies (NVLink); a plain memcpy when both are one device."""
        hw = self.cost.hardware
        bandwidth = hw.memory_bandwidth if src == dst else hw.device_link_bandwidth
        return self.link(f"{src}->{dst}", bandwidth, src)

    def device_of(self, store: str) -> str:
        """The device a KV store lives on (staging j on prefill device j mod P)."""
        cfg, index = self.config, int(store.lstrip("abcdefghijklmnopqrstuvwxyz") or 0)
        if store.startswith("decode"):
            return cfg.decode_devices[index]
        return cfg.prefill_devices[index % len(cfg.prefill_devices)]

    def link_for(self, move: Move) -> Link:
        """Host moves use the device's PCIe link, device moves the device link."""
        if move.dst == "host":
            return self.host_link(self.device_of(move.src), "d2h")
        if move.src == "host":
            return self.host_link(self.device_of(move.dst), "h2d")
        return self.peer_link(self.device_of(move.src), self.device_of(move.dst))

    def copy(self, move: Move, then: Callable[[Move, float], None]) -> float:
        """Moves `move`'s blocks over its link from now; at arrival the ledger commits it
        and `then(move, arrival)` runs. Returns the arrival time."""
        start = self.loop.now
        num_bytes = self.cost.kv_bytes(move.num_blocks, self.config.block_size)
        landed = self.link_for(move).transfer(start, num_bytes)

        def land() -> None:
            self.kv.commit(move, start, landed)
            then(move, landed)

        self.loop.at(landed, land)
        return landed


class Instance(SimActor):
    """One simulated instance: its core, on its device's compute timeline."""

    def __init__(self, ctx: SimContext, core: Any, device: str | None = None) -> None:
        super().__init__(ctx.loop)
        self.ctx, self.core = ctx, core
        self.device = ctx.device(device) if device is not None else None

    def compute(self, duration: float, then: Callback) -> None:
        """Busy for `duration` seconds of the device (after what it already runs), then
        `then()`."""
        assert self.device is not None, "only instances on a device compute"
        self.is_busy = True
        end = self.device.run(self.loop.now, duration)[1]
        self.loop.at(end, then)

    def finish(self, step: Forward, *times: float) -> None:
        """Hands the core the step's outputs (token 0 for every seq it samples for, no
        logprobs) and lands the forks it returns at once: a copy within one device that
        the cost model does not price (simulated workloads have no n > 1)."""
        tokens = [0 if s.num_computed_tokens + n == s.num_tokens else None
                  for s, n in zip(step.seqs, step.num_new_tokens)]
        forks = self.core.finish(step, tokens, [None] * len(step.seqs), self.loop.now, *times)
        for move in forks or ():
            self.ctx.kv.commit(move, self.loop.now, self.loop.now)
            self.core.forked(move, self.loop.now)


class PrefillInstance(Instance):
    """One prefill device: packed prefills, then offloads one by one over its PCIe link (it
    is busy until the last lands, as the engine awaits each move)."""

    def __init__(self, ctx: SimContext, index: int) -> None:
        super().__init__(ctx, PrefillCore(index, ctx.kv, ctx.life, ctx.wiring,
                                          ctx.config.scheduler.max_prefill_tokens),
                         ctx.config.prefill_devices[index])

    def act(self) -> None:
        if self.core.blocked:
            move = self.core.next_offload(self.loop.now)
            if move is not None:
                self.finish_at(self.ctx.copy(move, self.core.landed))
            if self.core.blocked or move is not None:
                return  # the pool is full (pool_space wakes it), or a copy is in flight
        step = self.ctx.decide(self.core.forward, self.loop.now) if self.core.can_prefill else None
        if step is not None:
            duration = self.ctx.cost.prefill_time(step.num_new_tokens)
            self.compute(duration, partial(self._done, step, duration))

    def _done(self, step: Forward, duration: float) -> None:
        self.finish(step, duration)
        self.is_busy = False
        self.act()


class Batcher(Instance):
    """Stages each order seq by seq over the prefill device's PCIe link, then delivers it.

    NOTE: orders for different instances overlap (each link queues its own copies), as in
    the paper. The engine's BatcherActor awaits each order before the next decision, which
    at paper scale would make one PCIe link the bound of the whole cluster.
    """

    def __init__(self, ctx: SimContext) -> None:
        cfg = ctx.config
        super().__init__(ctx, BatcherCore(ctx.policy, ctx.kv, ctx.life, ctx.wiring,
                                          cfg.num_decode_blocks, cfg.scheduler.batch_kv_fraction,
                                          cfg.scheduler.max_batch_size))

    def act(self) -> None:
        while (order := self.ctx.decide(self.core.next_order, self.loop.now)) is not None:
            self._stage(order)  # type: ignore[arg-type]

    def _stage(self, order: Order, *landed: object) -> None:
        move = self.core.next_move(order, self.loop.now)
        if move is None:
            self.core.deliver(order, self.loop.now)
            return
        self.ctx.copy(move, lambda m, t: (self.core.landed(order, m, t), self._stage(order)))


class DecodeInstance(Instance):
    """One decode device. A boundary's copies land one after another (the engine awaits
    each), then the forward runs for the cost model's time."""

    def __init__(self, ctx: SimContext, index: int) -> None:
        super().__init__(ctx, DecodeCore(index, ctx.policy, ctx.kv, ctx.life, ctx.wiring,
                                         ctx.config.scheduler.max_batch_size),
                         ctx.config.decode_devices[index])
        self._missed_wake = False

    def wake(self) -> None:
        if self.is_busy:
            self._missed_wake = True  # acted on when the boundary's copies have landed
        else:
            super().wake()

    def act(self) -> None:
        if not self.core.is_idle:
            start = self.loop.now
            moves = self.ctx.decide(self.core.boundary, start)
            self._carry_out(moves, partial(self._forward, start))  # type: ignore[arg-type]

    def _carry_out(self, moves: list[Move], then: Callback) -> None:
        """Copies `moves` one after another, then the admissions the core asks for once
        they landed, then calls `then`."""
        if not moves:
            moves = self.core.settled(self.loop.now)
            if not moves:
                then()
                return
        self.is_busy = True

        def landed(move: Move, now: float) -> None:
            self.core.landed(move, now)
            self._carry_out(moves[1:], then)

        self.ctx.copy(moves[0], landed)

    def _forward(self, start: float) -> None:
        self.is_busy = False
        step = self.core.forward(self.loop.now)
        if isinstance(step, list):  # nothing could run: an eviction, or wait for a batch
            if step:
                self._carry_out(step, self._resume)
            elif self._missed_wake:
                self._missed_wake = False
                self.wake()
            return
        forward_time = self.ctx.cost.iteration_time(step.lengths)
        self.compute(forward_time, partial(self._done, step, forward_time,
                                           self.loop.now - start))

    def _done(self, step: Forward, forward_time: float, schedule_time: float) -> None:
        self.finish(step, forward_time, schedule_time)
        self._resume()

    def _resume(self) -> None:
        self.is_busy = False
        self.act()


class ColocatedInstance(Instance):
    """One device of the `continuous` baseline."""

    def __init__(self, ctx: SimContext, index: int) -> None:
        cfg = ctx.config
        super().__init__(ctx, ColocatedCore(index, ctx.kv, ctx.life, ContinuousScheduler(
            cfg.scheduler.max_prefill_tokens, cfg.scheduler.max_batch_size, cfg.block_size)),
                         cfg.colocated_devices[index])

    def act(self) -> None:
        if self.core.is_idle:
            return
        step = self.ctx.decide(self.core.forward, self.loop.now)
        if step is None:
            return  # nothing fits: wait for the next arrival
        decode = [s.num_tokens for s in step.seqs if s.status == SeqStatus.DECODING]  # type: ignore[attr-defined]
        chunks = [(s.num_computed_tokens, n) for s, n in zip(step.seqs, step.num_new_tokens)  # type: ignore[attr-defined]
                  if s.status == SeqStatus.PREFILLING]
        forward_time = self.ctx.cost.iteration_time(decode, chunks)
        self.compute(forward_time, partial(self._done, step, forward_time))

    def _done(self, step: Forward, forward_time: float) -> None:
        self.finish(step, forward_time, 0.0)
        self.is_busy = False
        self.act()


def build_instances(ctx: SimContext) -> list[Instance]:
    """The simulated instances of `ctx`'s policy, wired to one another; returns them all."""
    cfg = ctx.config
    if not ctx.policy.uses_pool:
        return ctx.wiring.connect(  # type: ignore[return-value]
            [], None, [ColocatedInstance(ctx, k) for k in range(len(cfg.colocated_devices))])
    return ctx.wiring.connect(  # type: ignore[return-value]
        [PrefillInstance(ctx, i) for i in range(len(cfg.prefill_devices))], Batcher(ctx),
        [DecodeInstance(ctx, j) for j in range(len(cfg.decode_devices))])
