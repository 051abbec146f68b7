"""ContinuousActor: the `continuous` baseline (vLLM / Orca): prefill and decode on one
device, FCFS continuous batching over paged KV with chunked prefill mixed into decode
iterations under a token budget; no pool, preemption by recompute.

Each step: receive -> decide (ContinuousScheduler.plan) -> act (blocks) -> run -> emit.
"""

from __future__ import annotations

from collections import deque

from aserve.actors.base import Actor, EngineContext, now, work_item
from aserve.core import IterationRecord, SeqStatus, Sequence
from aserve.messages import Abort, Message, Stop, Submit
from scheduler import ContinuousScheduler, ContinuousSeq


class ContinuousActor(Actor):
    """One colocated instance: a waiting queue, a running batch, one KV cache."""

    def __init__(self, ctx: EngineContext, index: int) -> None:
        super().__init__(ctx)
        self.index = index
        self.name = f"decode{index}"
        self.store = ctx.kv[self.name]
        self.runner = ctx.runners[ctx.config.decode_devices[index]]
        sched = ctx.config.scheduler
        self.scheduler = ContinuousScheduler(sched.max_prefill_tokens, sched.max_batch_size,
                                             ctx.kv.geometry.block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def num_waiting_tokens(self) -> int:
        return sum(seq.num_tokens for seq in self.waiting)

    async def run(self) -> None:
        while True:
            if not (self.waiting or self.running) and self.receive(await self.inbox.get()):
                return
            while not self.inbox.empty():
                if self.receive(self.inbox.get_nowait()):
                    return
            if not (self.waiting or self.running):
                continue
            try:
                await self.step()
            except Exception as exc:  # boundary: the running batch fails, the queue survives
                self.fail(self.running, self.record_error(exc))
                self.running = []

    def receive(self, message: Message) -> bool:
        if isinstance(message, Stop):
            return True
        if isinstance(message, Submit):
            (self.waiting.appendleft if message.front else self.waiting.append)(message.seq)
        elif isinstance(message, Abort):
            self.waiting = deque(self.reap(list(self.waiting)))
        return False

    def _view(self, seq: Sequence) -> ContinuousSeq:
        num_blocks = len(self.ctx.kv.table(seq)) if seq.location else 0
        return ContinuousSeq(seq.seq_id, seq.num_tokens, seq.num_computed_tokens, num_blocks,
                             seq.request.arrival_time)

    def preempt(self, seq: Sequence) -> None:
        """Frees the KV of a running sequence and queues it first for recompute."""
        self.running.remove(seq)
        self.ctx.kv.release(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        self.ctx.outputs.event(seq.seq_id, "evicted")
        self.waiting.appendleft(seq)

    def _schedule(self) -> list[tuple[Sequence, int]]:
        """Asks the scheduler for this step's work and gives it KV blocks."""
        self.running = self.reap(self.running)
        self.waiting = deque(self.reap(list(self.waiting)))
        plan = self.scheduler.plan([self._view(s) for s in self.running],
                                   [self._view(s) for s in self.waiting],
                                   self.store.allocator.num_free)
        by_id = {s.seq_id: s for s in (*self.running, *self.waiting)}
        for seq_id in plan.preempt:
            self.preempt(by_id[seq_id])
        work = []
        for seq_id, num_new in plan.scheduled:
            seq = by_id[seq_id]
            end = seq.num_computed_tokens + num_new
            ok = (self.ctx.kv.grow(seq, end) if seq.location
                  else self.ctx.kv.allocate(seq, self.name, end))
            assert ok, f"scheduler over-committed blocks for {seq_id}"
            if seq.status == SeqStatus.WAITING:
                self.waiting.remove(seq)
                self.running.append(seq)
                seq.status = SeqStatus.PREFILLING
                self.ctx.outputs.event(seq_id, "prefill_start")
            work.append((seq, num_new))
        return work

    async def step(self) -> None:
        start = now()
        work = self._schedule()
        if not work:
            if self.receive(await self.inbox.get()):  # nothing fits: wait, never spin
                self.stop()
            return
        schedule_time = now() - start
        start = now()
        lengths = [seq.num_computed_tokens + n for seq, n in work]
        items = [work_item(seq, self.ctx.kv.table(seq), n) for seq, n in work]
        result = await self.runner.execute(items, self.store.tensor)
        end = now()
        num_prefill = 0
        for (seq, n), token_id, logprob in zip(work, result.token_ids, result.logprobs):
            was_prefill = seq.status == SeqStatus.PREFILLING
            num_prefill += n if was_prefill else 0
            seq.num_computed_tokens += n
            if token_id is None:
                continue
            if was_prefill:
                self.ctx.outputs.event(seq.seq_id, "prefill_end", end)
                forked, unforked = await self.spawn_forks(seq)
                self.running.extend(forked)
                self.waiting.extendleft(reversed(unforked))
                seq.status = SeqStatus.DECODING
            if not seq.is_finished:
                self.ctx.outputs.append_token(seq, token_id, logprob, end)
        self.ctx.outputs.iteration(IterationRecord(
            instance=self.name, start_time=start, batch_size=len(work),
            num_prefill_tokens=num_prefill, min_len=min(lengths), max_len=max(lengths),
            forward_time=result.forward_time, schedule_time=schedule_time, is_mixed=False,
            blocks_used=self.ctx.kv.blocks_used(),
        ))
        self.running = self.reap(self.running)
