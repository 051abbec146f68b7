"""The simulator's driver of the scheduling cores (aserve/cores): each instance is a thin
shell that runs its core's forward passes for the cost model's time on a simulated device
and its KV moves over simulated links with their queues. The decisions are the cores'.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

from aserve.cores import BlockLedger, Core, Forward, Lifecycle, Move, Wiring, kv_stores
from aserve.engine.sequence import SeqStatus
from scheduler import Policy
from scheduler.cost_model import CostModel
from sim.cluster import ClusterConfig
from sim.loop import Device, EventLoop

if TYPE_CHECKING:
    from sim.nodes import Network


@dataclass
class SimContext:
    """What the simulated instances of one run share."""

    config: ClusterConfig
    cost: CostModel
    policy: Policy
    record_tokens: bool = True
    network: Network | None = None  # nodes and the link between them; None: one node
    loop: EventLoop = field(default_factory=EventLoop)
    links: dict[str, Device] = field(default_factory=dict)  # a GPU's link timelines
    policy_time: float = 0.0  # real seconds spent deciding (inside the cores), not simulated
    wiring: Wiring = field(default_factory=Wiring)
    kv: BlockLedger = field(init=False)
    life: Lifecycle = field(init=False)
    store_devices: dict[str, str] = field(init=False)  # KV store -> its device
    devices: dict[str, Device] = field(init=False)  # the compute timeline of each device
    steps: dict[str, StepQueue] = field(init=False)  # each device's steps waiting for it
    decode_devices: tuple[str, ...] = field(init=False)  # colocated ones without a pool

    def __post_init__(self) -> None:
        cfg = self.config
        self.decode_devices = (cfg.decode_devices if self.policy.uses_pool
                               else cfg.colocated_devices)
        stores = kv_stores(cfg.prefill_devices, self.decode_devices, cfg, cfg.num_host_blocks)
        self.store_devices = {name: dev for name, (dev, _) in stores.items() if name != "host"}
        self.devices = {dev: Device(dev) for dev in self.store_devices.values()}
        fuse = cfg.fuse_steps and cfg.share_kv_memory  # one KV tensor per device
        self.steps = {dev: StepQueue(self, device, fuse) for dev, device in self.devices.items()}
        self.kv = BlockLedger(stores, cfg.block_size, cfg.share_kv_memory)
        self.life = Lifecycle(self.kv, eos_token_id=-1, record_tokens=self.record_tokens)

    def forward_time(self, *steps: Forward) -> float:
        """The cost model's seconds for one forward over `steps`: their prefill chunks and
        decode tokens."""
        decode: list[int] = []
        prefill: list[tuple[int, int]] = []
        for step in steps:
            for seq, num_new in zip(step.seqs, step.num_new_tokens):
                if seq.status == SeqStatus.PREFILLING:
                    prefill.append((seq.num_computed_tokens, num_new))
                else:
                    decode.append(seq.num_tokens)
        return self.cost.iteration_time(decode, prefill)

    def transfer(self, move: Move, start: float) -> float:
        """Books `move`'s copy from `start` on its link and returns when it lands. Host moves
        use the device's PCIe link, one per direction; device moves the device link
        (NVLink), or a plain memcpy within one device; between devices on two nodes of a
        `network`, its link from one node to the other (sim/nodes.py). A link is a timeline
        of its own whose copies queue behind each other (FIFO); on a CPU
        (`not hardware.is_gpu`) the copies occupy the device's compute timeline, as the
        engine runs CPU-to-CPU copies in the device's thread, between its forwards."""
        hw = self.cost.hardware
        src, dst = (self.store_devices.get(name, "host") for name in (move.src, move.dst))
        num_bytes = self.cost.kv_bytes(move.num_blocks, self.config.block_size)
        if self.network is not None and (hop := self.network.hop(src, dst)) is not None:
            link = self.links.setdefault(hop.name, Device(hop.name))  # a NIC, one way
            return link.run(start, hop.latency + num_bytes / hop.bandwidth)[1]
        if move.src == "host":
            device, name, bandwidth = dst, f"{dst}.h2d", hw.host_link_bandwidth
        elif move.dst == "host":
            device, name, bandwidth = src, f"{src}.d2h", hw.host_link_bandwidth
        else:
            device, name = src, f"{src}->{dst}"
            bandwidth = hw.memory_bandwidth if src == dst else hw.device_link_bandwidth
        link = self.links.setdefault(name, Device(name)) if hw.is_gpu else self.devices[device]
        return link.run(start, num_bytes / bandwidth)[1]


class Instance:
    """One simulated instance: its core (any kind: the loop is the same), on its device's
    compute timeline. `wake()` is a message arriving: the instance acts once the current
    callback ends, or, when busy, once its work is done."""

    def __init__(self, ctx: SimContext, core: Core, device: str | None = None) -> None:
        self.ctx, self.core, self.loop = ctx, core, ctx.loop
        self.device = ctx.devices[device] if device is not None else None
        if device is not None:
            ctx.steps[device].users += 1
        self.is_busy = False
        self._is_woken = False  # a wake is scheduled, or came while busy
        self._decided = 0.0  # real seconds of decisions since the last forward

    def wake(self) -> None:
        if not self._is_woken:
            self._is_woken = True
            if not self.is_busy:
                self.loop.soon(self._on_wake)

    def _on_wake(self) -> None:
        self._is_woken = False
        if not self.is_busy:
            self.act()

    def act(self) -> None:
        """Does what the core asks for until it asks for nothing or its device is busy. A
        forward runs for the cost model's time; copies land one after another, except the
        batcher's (no device): orders for different instances overlap, each link queuing
        its own copies, as in the paper (the engine's batcher runs each copy as a task).
        """
        self.is_busy = False
        # NOTE: a hand-over lands at once, and the batcher acts again after each copy lands:
        # done by recursion, a backlog handed over at once nests an act per seq. So each
        # nested act is a level of this stack, the batcher's copies still to start; the
        # order is the recursion's (depth first).
        levels: list[list[Move]] = [[]]
        while levels:
            if levels[-1]:
                if self._copy([levels[-1].pop(0)], then_act=False):
                    levels.append([])  # landed at once: act again before the next copy
                continue
            began = time.perf_counter()
            work = self.core.step(self.loop.now)
            spent = time.perf_counter() - began
            self._decided += spent
            self.ctx.policy_time += spent
            if work is None:
                if self._is_woken:  # woken while busy: act again once the loop is free
                    self.loop.soon(self._on_wake)
                levels.pop()
                continue
            if self.device is None:  # the batcher's copies: each acts again once landed
                levels[-1] = list(work)  # type: ignore[arg-type]
                continue
            self.is_busy = True
            if isinstance(work, Forward):
                self.ctx.steps[self.device.name].submit(self, work)
            else:
                self._copy(work)
            return

    def _copy(self, moves: list[Move], then_act: bool = True) -> bool:
        """Copies `moves` one after another (the engine awaits each), each over its link
        from now; at its arrival the ledger commits it and the core is told. Then acts
        again, or, with `then_act` False where all landed at once, returns True for the
        caller to act."""
        for i, move in enumerate(moves):
            start = self.loop.now
            if move.handover:  # one KV tensor changes stores: lands at once, as the
                # engine's (KVSpace.copy awaits nothing)
                self.ctx.kv.commit(move, start, start)
                self.core.landed(move, start)
                continue
            end = self.ctx.transfer(move, start)
            rest = moves[i + 1:]

            def land(move: Move = move, start: float = start, end: float = end) -> None:
                self.ctx.kv.commit(move, start, end)
                self.core.landed(move, end)
                self._copy(rest)

            self.loop.at(end, land)
            return False
        if then_act:
            self.act()
            return False
        return True

    def finish(self, step: Forward, duration: float, fused: bool) -> None:
        """Hands the core the step's outputs: token 0 for every seq it samples for, no
        logprobs."""
        tokens = [0 if end == s.num_tokens else None for s, end in zip(step.seqs, step.lengths)]
        forks = self.core.finish(step, tokens, [None] * len(step.seqs), self.loop.now,
                                 duration, self._decided, fused)
        self._decided = 0.0
        self._copy(forks)


class StepQueue:
    """One device's forwards, as the engine's `StepQueue` (aserve/engine/actors.py) runs
    them: with `fuse` and more than one instance on the device, the steps they submit while
    it is busy (or in the same instant) wait and start together as one forward once it is
    free, each instance finishing with that forward's time; else each is booked on its own."""

    def __init__(self, ctx: SimContext, device: Device, fuse: bool) -> None:
        self.ctx, self.device, self.fuse = ctx, device, fuse
        self.users = 0  # the instances on the device (each counts itself in)
        self.waiting: list[tuple[Instance, Forward]] = []

    def submit(self, instance: Instance, step: Forward) -> None:
        if not self.fuse or self.users < 2:
            self._run([(instance, step)])
            return
        self.waiting.append((instance, step))
        if len(self.waiting) == 1:  # the first waiting: start them once the device is free
            self.ctx.loop.at(max(self.ctx.loop.now, self.device.busy_until), self._start,
                             settled=True)

    def _start(self) -> None:
        """Runs the waiting steps as one forward, once the device is free and the instant
        has settled: the instances that the last forward's end woke (a decode instance
        handed the prompts it prefilled, say) submit their steps in that same instant, as
        the engine's queue yields once before a forward so that they can."""
        loop = self.ctx.loop
        if self.device.busy_until > loop.now:  # a copy booked the device meanwhile
            loop.at(self.device.busy_until, self._start, settled=True)
            return
        waiting, self.waiting = self.waiting, []
        self._run(waiting)

    def _run(self, steps: list[tuple[Instance, Forward]]) -> None:
        duration = self.ctx.forward_time(*(step for _, step in steps))
        end = self.device.run(self.ctx.loop.now, duration)[1]
        for instance, step in steps:
            self.ctx.loop.at(end, partial(instance.finish, step, duration, len(steps) > 1))
