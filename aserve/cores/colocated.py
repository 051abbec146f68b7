"""ColocatedCore: the `continuous` baseline (vLLM / Orca): prefill and decode on one device,
FCFS continuous batching with chunked prefill mixed into decode iterations under a token
budget (ContinuousScheduler), preemption by recompute, no pool."""

from __future__ import annotations

from sortedcontainers import SortedKeyList

from aserve.core import IterationRecord, SeqStatus, Sequence
from aserve.cores.base import Forward, Move
from aserve.cores.kv import BlockLedger
from aserve.cores.lifecycle import Lifecycle
from scheduler import ContinuousScheduler, ContinuousSeq


def _arrival_order(seq: Sequence) -> tuple[float, str]:
    return seq.request.arrival_time, seq.seq_id


class ColocatedCore:
    """A waiting queue (arrival order), a running batch, one KV cache."""

    def __init__(self, index: int, kv: BlockLedger, life: Lifecycle,
                 scheduler: ContinuousScheduler) -> None:
        self.index, self.name = index, f"decode{index}"
        self.kv, self.life, self.scheduler = kv, life, scheduler
        self.waiting = SortedKeyList(key=_arrival_order)
        self.running: list[Sequence] = []

    @property
    def num_waiting_tokens(self) -> int:
        return sum(seq.num_tokens for seq in self.waiting)

    @property
    def is_idle(self) -> bool:
        return not (self.waiting or self.running)

    def submit(self, seq: Sequence, front: bool = False) -> None:
        """A new request; `front` is accepted for symmetry (the queue is in arrival order)."""
        seq.status = SeqStatus.WAITING
        self.waiting.add(seq)

    def reap(self, now: float) -> None:
        """Ends the waiting seqs an abort asked to end (they hold no KV)."""
        for seq in list(self.waiting):
            if seq.seq_id in self.life.finish_requests:
                self.waiting.remove(seq)
                self.life.reap([seq], now)

    def _view(self, seq: Sequence) -> ContinuousSeq:
        num_blocks = len(self.kv.table(seq)) if seq.location else 0
        return ContinuousSeq(seq.seq_id, seq.num_tokens, seq.num_computed_tokens, num_blocks,
                             seq.request.arrival_time)

    def forward(self, now: float) -> Forward | None:
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
        seqs, num_new_tokens = [], []
        for seq_id, num_new in plan.scheduled:
            seq = by_id[seq_id]
            end = seq.num_computed_tokens + num_new
            ok = (self.kv.grow(seq, end) if seq.location
                  else self.kv.allocate(seq, self.name, end))
            assert ok, f"scheduler over-committed blocks for {seq_id}"
            if seq.status == SeqStatus.WAITING:
                self.waiting.remove(seq)
                self.running.append(seq)
                seq.status = SeqStatus.PREFILLING
                self.life.event(seq_id, "prefill_start", now)
            seqs.append(seq)
            num_new_tokens.append(num_new)
        return Forward(self.name, seqs, num_new_tokens, now) if seqs else None

    def _preempt(self, seq: Sequence, now: float) -> None:
        """Frees a running seq's KV and queues it again for recompute."""
        self.running.remove(seq)
        self.kv.release(seq)
        seq.num_computed_tokens = 0
        self.life.event(seq.seq_id, "evicted", now)
        self.submit(seq)

    def finish(self, step: Forward, token_ids: list[int | None],
               logprobs: list[float | None], now: float, forward_time: float,
               schedule_time: float) -> list[Move]:
        """The step ran: prefill chunks advance, seqs that sampled get their token. Returns
        the KV copies of the samples forked from prompts whose prefill ended (n > 1), which
        the driver carries out before the next step, calling `forked` as each lands."""
        lengths = step.lengths
        num_prefill = 0
        forks: list[Move] = []
        for seq, n, token_id, logprob in zip(step.seqs, step.num_new_tokens, token_ids,
                                             logprobs):
            was_prefill = seq.status == SeqStatus.PREFILLING
            num_prefill += n if was_prefill else 0
            seq.num_computed_tokens += n
            if token_id is None:
                continue  # a prefill chunk that samples nothing yet
            if was_prefill:
                self.life.event(seq.seq_id, "prefill_end", now)
                # NOTE: before the token may free `seq`'s blocks; copied in order (see
                # PrefillCore.finish)
                moves, unforked = self.life.fork(seq, now)
                forks.extend(moves)
                for child in unforked:
                    self.submit(child)
                seq.status = SeqStatus.DECODING
            if not seq.is_finished:
                self.life.append_token(seq, token_id, logprob, now)
        self.life.iteration(IterationRecord(
            instance=self.name, start_time=step.start_time, batch_size=len(step.seqs),
            num_prefill_tokens=num_prefill, min_len=min(lengths), max_len=max(lengths),
            forward_time=forward_time, schedule_time=schedule_time, is_mixed=False,
            blocks_used=self.kv.blocks_used()))
        self.running = [s for s in self.running if not s.is_finished]
        return forks

    def forked(self, move: Move, now: float) -> None:
        """A sample's copy of its prompt's KV landed: it runs from its last prompt token."""
        self.running.append(move.seq)

    def fail(self, error: str, now: float) -> None:
        """The forward pass failed: the running batch ends with an error."""
        for seq in self.running:
            self.life.finish(seq, SeqStatus.FINISHED_ERROR, error, at=now)
        self.running = []
