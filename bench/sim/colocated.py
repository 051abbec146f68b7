"""Simulated colocated instance for the `continuous` baseline (aserve/actors/continuous.py):
prefill and decode on one device, `ContinuousScheduler.plan` every step, chunked prefill
mixed into decode iterations, preemption by recompute, no pool.
"""

from __future__ import annotations

import time

from sortedcontainers import SortedKeyList

from aserve.core import IterationRecord
from bench.sim.cluster import SimContext
from bench.sim.loop import DECODING, PREFILLING, WAITING, SimActor, SimSeq
from scheduler import ContinuousScheduler, ContinuousSeq


def _arrival_order(seq: SimSeq) -> tuple[float, str]:
    return seq.arrival_time, seq.seq_id


class ColocatedInstance(SimActor):
    """One device: a waiting queue (arrival order), a running batch, one KV store."""

    def __init__(self, ctx: SimContext, index: int, device: str) -> None:
        super().__init__(ctx.loop)
        cfg = ctx.config
        self.ctx, self.index = ctx, index
        self.name = f"decode{index}"
        self.device = ctx.device(device)
        self.store = ctx.store(self.name, "decode", cfg.num_decode_blocks)
        self.scheduler = ContinuousScheduler(cfg.max_prefill_tokens, cfg.max_batch_size,
                                             cfg.block_size)
        self.waiting = SortedKeyList(key=_arrival_order)
        self.running: list[SimSeq] = []
        self.num_waiting_tokens = 0

    def submit(self, seq: SimSeq, front: bool = False) -> None:
        """A new request; `front` is accepted for symmetry (the queue is in arrival order)."""
        seq.status = WAITING
        self.waiting.add(seq)
        self.num_waiting_tokens += seq.num_tokens
        self.wake()

    def act(self) -> None:
        if self.waiting or self.running:
            self._step()

    def _view(self, seq: SimSeq) -> ContinuousSeq:
        return ContinuousSeq(seq.seq_id, seq.num_tokens, seq.num_computed, seq.num_blocks,
                             seq.arrival_time)

    def _schedule(self) -> list[tuple[SimSeq, int]]:
        """Asks the scheduler for this step's work and gives it KV blocks.

        NOTE: only the first max_batch_size waiting seqs (arrival order) are shown: the
        scheduler admits waiting seqs in that order and never more than a batch, so the
        plan is the one it would make over the whole queue, at a fraction of the cost.
        """
        ctx, cfg = self.ctx, self.ctx.config
        head = list(self.waiting.islice(0, cfg.max_batch_size))
        began = time.perf_counter()
        plan = self.scheduler.plan([self._view(s) for s in self.running],
                                   [self._view(s) for s in head], self.store.num_free)
        ctx.policy_time += time.perf_counter() - began
        by_id = {s.seq_id: s for s in (*self.running, *head)}
        for seq_id in plan.preempt:
            self._preempt(by_id[seq_id])
        work = []
        for seq_id, num_new in plan.scheduled:
            seq = by_id[seq_id]
            end = seq.num_computed + num_new
            is_ok = (ctx.stores.grow(seq, end) if seq.location is not None
                     else ctx.stores.allocate(seq, self.store, end))
            assert is_ok, f"scheduler over-committed blocks for {seq_id}"
            if seq.status == WAITING:
                self.waiting.remove(seq)
                self.num_waiting_tokens -= seq.num_tokens
                self.running.append(seq)
                seq.status = PREFILLING
                ctx.recorder.event(seq, "prefill_start", ctx.loop.now)
            work.append((seq, num_new))
        return work

    def _preempt(self, seq: SimSeq) -> None:
        """Frees a running seq's KV and queues it again for recompute."""
        self.running.remove(seq)
        self.ctx.stores.release(seq)
        seq.num_computed = 0
        self.ctx.recorder.event(seq, "evicted", self.ctx.loop.now)
        self.submit(seq)

    def _step(self) -> None:
        start = self.ctx.loop.now
        work = self._schedule()
        if not work:
            return  # nothing fits: wait for the next arrival
        decode = [seq.num_tokens for seq, _ in work if seq.status == DECODING]
        chunks = [(seq.num_computed, n) for seq, n in work if seq.status == PREFILLING]
        lengths = [seq.num_computed + n for seq, n in work]
        forward_time = self.ctx.cost.iteration_time(decode, chunks)
        _, end = self.device.run(start, forward_time)
        self.is_busy = True
        self.ctx.loop.at(end, lambda: self._done(start, work, lengths, forward_time))

    def _done(self, start: float, work: list[tuple[SimSeq, int]], lengths: list[int],
              forward_time: float) -> None:
        ctx = self.ctx
        now, rec = ctx.loop.now, ctx.recorder
        num_prefill = 0
        finished = []
        for seq, num_new in work:
            was_prefill = seq.status == PREFILLING
            num_prefill += num_new if was_prefill else 0
            seq.num_computed += num_new
            if seq.num_computed < seq.num_tokens:
                continue  # a prefill chunk that samples nothing yet
            if was_prefill:
                rec.event(seq, "prefill_end", now)
                seq.status = DECODING
            if rec.token(seq, now):
                finished.append(seq)
        rec.iterations.append(IterationRecord(
            instance=self.name, start_time=start, batch_size=len(work),
            num_prefill_tokens=num_prefill, min_len=min(lengths), max_len=max(lengths),
            forward_time=forward_time, schedule_time=0.0, is_mixed=False,
            blocks_used=ctx.stores.used()))
        self.running = ctx.stores.retire(self.running, finished)
        self.is_busy = False
        self.act()
