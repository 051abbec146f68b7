"""The state machine of a colocated instance (the `continuous` baseline)."""

from __future__ import annotations

from typing import Any

from sortedcontainers import SortedKeyList

from aserve.cores.base import Core, Forward, Move
from aserve.engine.sequence import SeqState, SeqStatus
from scheduler import ContinuousScheduler, ContinuousSeq

# -- colocated ------------------------------------------------------------------------
# ColocatedCore: the `continuous` baseline (vLLM / Orca): prefill and decode on one device,
# FCFS continuous batching with chunked prefill mixed into decode iterations under a token
# budget (ContinuousScheduler), preemption by recompute, no pool.


def _arrival_order(seq: SeqState) -> tuple[float, str]:
    return seq.request.arrival_time, seq.seq_id


class ColocatedCore(Core):
    """A waiting queue (arrival order), a running batch, one KV cache."""

    prefilled = SeqStatus.DECODING

    def __init__(self, ctx: Any, index: int) -> None:
        super().__init__(ctx, f"decode{index}", index)
        self.scheduler = ContinuousScheduler(self.sched.max_prefill_tokens,
                                             self.sched.max_batch_size, self.kv.block_size)
        self.waiting = SortedKeyList(key=_arrival_order)
        self.running: list[SeqState] = []

    def submit(self, seq: SeqState, front: bool = False) -> None:
        """A new request; `front` is accepted for symmetry (the queue is in arrival order)."""
        self.life.transition(seq, SeqStatus.WAITING)
        self.waiting.add(seq)

    def reap(self, now: float) -> None:
        """Ends the waiting seqs an abort asked to end (they hold no KV)."""
        if any(seq.seq_id in self.life.finish_requests for seq in self.waiting):
            self.waiting = SortedKeyList(self.life.reap(list(self.waiting), now),
                                         key=_arrival_order)

    def _view(self, seq: SeqState) -> ContinuousSeq:
        num_blocks = len(self.kv.table(seq)) if seq.location else 0
        return ContinuousSeq(seq.seq_id, seq.num_tokens, seq.num_computed_tokens, num_blocks,
                             seq.request.arrival_time)

    def step(self, now: float) -> Forward | None:
        """This step's work from the scheduler, with its KV blocks; None when nothing fits.

        NOTE: only the first max_batch_size waiting seqs (arrival order) are shown: the
        scheduler admits waiting seqs in that order and never more than a batch, so the
        plan is the one it would make over the whole queue, at a fraction of the cost.
        """
        self.running = self.life.reap(self.running, now)
        self.reap(now)
        head = list(self.waiting.islice(0, self.scheduler.max_batch_size))
        plan = self.scheduler.plan([self._view(s) for s in self.running],
                                   [self._view(s) for s in head], self.kv.free_blocks(self.name))
        by_id = {s.seq_id: s for s in (*self.running, *head)}
        for seq_id in plan.preempt:
            self._preempt(by_id[seq_id], now)
        seqs = [by_id[seq_id] for seq_id, _ in plan.scheduled]
        num_new_tokens = [num_new for _, num_new in plan.scheduled]
        for seq, num_new in zip(seqs, num_new_tokens):
            end = seq.num_computed_tokens + num_new
            ok = (self.kv.grow(seq, end) if seq.location
                  else self.kv.allocate(seq, self.name, end))
            assert ok, f"scheduler over-committed blocks for {seq.seq_id}"
            if seq.status == SeqStatus.WAITING:
                self.waiting.remove(seq)
                self.running.append(seq)
                self.life.transition(seq, SeqStatus.PREFILLING)
                self.life.event(seq.seq_id, "prefill_start", now)
        return Forward(self.name, seqs, num_new_tokens, now) if seqs else None

    def _preempt(self, seq: SeqState, now: float) -> None:
        """Frees a running seq's KV and queues it again for recompute."""
        self.running.remove(seq)
        self.kv.release(seq)
        seq.num_computed_tokens = 0
        self.life.event(seq.seq_id, "evicted", now)
        self.submit(seq)

    def landed(self, move: Move, now: float) -> None:
        """A sample's copy of its prompt's KV landed: it runs from its last prompt token."""
        self.running.append(move.seq)
