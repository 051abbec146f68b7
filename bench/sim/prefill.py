"""Simulated prefill instance: packed prefill under a token budget, then each request's KV is
offloaded to the host pool over the device's host link, in order, while the pool has room.

Mirrors aserve/actors/prefill.py: the instance does not start a prefill while offloads are
in flight or blocked on a full pool (backpressure).
"""

from __future__ import annotations

from collections import deque
from functools import partial
from typing import TYPE_CHECKING

from bench.sim.cluster import SimContext
from bench.sim.loop import PREFILLING, WAITING, SimActor, SimSeq

if TYPE_CHECKING:
    from bench.sim.pool import Pool


class PrefillInstance(SimActor):
    """One prefill device: a waiting queue, a scratch store, and its offload link."""

    def __init__(self, ctx: SimContext, index: int, pool: Pool) -> None:
        super().__init__(ctx.loop)
        cfg = ctx.config
        self.ctx, self.index, self.pool = ctx, index, pool
        self.device_name = cfg.prefill_devices[index]
        self.device = ctx.device(self.device_name)
        self.scratch = ctx.store(f"prefill{index}", "prefill", cfg.num_prefill_blocks)
        self.offload_link = ctx.host_link(self.device_name, "d2h")
        self.waiting: deque[SimSeq] = deque()
        self.blocked: deque[SimSeq] = deque()  # prefilled; waiting for host-pool room
        self.num_waiting_tokens = 0

    def submit(self, seq: SimSeq, front: bool = False) -> None:
        """A new (or recompute-evicted) request; `front` puts it first in line."""
        seq.status = WAITING
        (self.waiting.appendleft if front else self.waiting.append)(seq)
        self.num_waiting_tokens += seq.num_tokens
        self.wake()

    def act(self) -> None:
        """Offload what is blocked, else prefill the next batch."""
        if self.blocked:
            self._offload()
            if self.is_busy or self.blocked:
                return
        if self.waiting:
            self._step()

    def _take_batch(self) -> list[SimSeq]:
        budget = self.ctx.config.max_prefill_tokens
        batch: list[SimSeq] = []
        while self.waiting:
            seq = self.waiting[0]
            if batch and seq.num_tokens > budget:
                break
            if not self.ctx.stores.allocate(seq, self.scratch, seq.num_tokens):
                break
            batch.append(self.waiting.popleft())
            budget -= seq.num_tokens
            self.num_waiting_tokens -= seq.num_tokens
        return batch

    def _step(self) -> None:
        batch = self._take_batch()
        assert batch, "requests are checked against the scratch store before the run"
        loop, rec = self.ctx.loop, self.ctx.recorder
        for seq in batch:
            seq.status = PREFILLING
            rec.event(seq, "prefill_start", loop.now)
        duration = self.ctx.cost.prefill_time([seq.num_tokens for seq in batch])
        _, end = self.device.run(loop.now, duration)
        self.is_busy = True
        loop.at(end, lambda: self._done(batch))

    def _done(self, batch: list[SimSeq]) -> None:
        now, rec = self.ctx.loop.now, self.ctx.recorder
        for seq in batch:
            seq.num_computed = seq.num_tokens
            rec.event(seq, "prefill_end", now)
            if rec.token(seq, now):
                self.ctx.stores.release(seq)
            else:
                self.blocked.append(seq)
        self.is_busy = False
        self.act()

    def _offload(self) -> None:
        """Copies the first blocked request to the host pool if it has room; it is pooled
        when its copy lands, and the next one starts then (the engine awaits each move, so
        on a CPU, where copies run in the device's thread, forwards queued meanwhile run
        between them). The instance is busy until the last copy lands."""
        seq = self.blocked[0]
        num_blocks = self.ctx.stores.move(seq, self.pool.host)
        if not num_blocks:
            return  # the pool is full: notify_space wakes the instance
        self.blocked.popleft()
        landed = self.ctx.copy(self.offload_link, self.ctx.loop.now, num_blocks)
        self.ctx.loop.at(landed, partial(self.pool.add, seq))
        self.finish_at(landed)
