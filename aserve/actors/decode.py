"""DecodeActor: decode iterations on one decode device, with the policy consulted at every
iteration boundary (release, evict, refill from candidate requests, switch batches).

Each boundary: receive -> decide (policy.plan_boundary) -> act (KV moves) -> run -> emit.
"""

from __future__ import annotations

import logging

from aserve.actors.base import Actor, EngineContext, now, seq_view, work_item
from aserve.core import IterationRecord, SeqStatus, Sequence
from aserve.messages import (
    CandidateBatch,
    CandidateRequests,
    Message,
    PoolChanged,
    Pooled,
    RunningWindow,
    Stop,
    Submit,
    WantBatch,
)
from scheduler import BoundaryPlan, BoundaryView

logger = logging.getLogger(__name__)


class DecodeActor(Actor):
    """One decode instance: the running batch and its two candidate buffers."""

    def __init__(self, ctx: EngineContext, index: int) -> None:
        super().__init__(ctx)
        self.index = index
        self.name = f"decode{index}"
        self.staging = f"staging{index}"
        self.store = ctx.kv[self.name]
        self.runner = ctx.runners[ctx.config.decode_devices[index]]
        self.running: list[Sequence] = []
        self.cand_requests: list[Sequence] = []  # evicted or dynamically prefetched
        self.cand_batch: list[Sequence] = []
        self.cand_batch_id = -1
        self.current_batch_id = -1
        self.want_sent = False
        self.window: tuple[int, int] | None = None

    @property
    def is_idle(self) -> bool:
        return not (self.running or self.cand_requests or self.cand_batch)

    async def run(self) -> None:
        self.ask_for_batch()
        while True:
            if self.is_idle and self.receive(await self.inbox.get()):
                return
            while not self.inbox.empty():
                if self.receive(self.inbox.get_nowait()):
                    return
            if self.is_idle:
                continue
            try:
                await self.iteration()
            except Exception as exc:  # boundary: the running batch fails, buffers survive
                self.fail(self.running, self.record_error(exc))
                self.running = []

    def receive(self, message: Message) -> bool:
        if isinstance(message, Stop):
            return True
        if isinstance(message, CandidateBatch):
            assert not self.cand_batch, f"{self.name} got a batch while holding one"
            self.cand_batch, self.cand_batch_id = message.seqs, message.batch_id
            self.want_sent = False
        elif isinstance(message, CandidateRequests):
            self.cand_requests.extend(message.seqs)
        return False

    def ask_for_batch(self) -> None:
        if not self.cand_batch and not self.want_sent and self.ctx.batcher is not None:
            self.ctx.batcher.send(WantBatch(self.index))
            self.want_sent = True

    def _view(self) -> BoundaryView:
        blocks = self.ctx.kv.blocks_for
        views = lambda seqs: tuple(seq_view(s, blocks(s.num_computed_tokens)) for s in seqs)  # noqa: E731
        return BoundaryView(
            running=views(self.running),
            free_blocks=self.store.allocator.num_free,
            block_size=self.ctx.kv.geometry.block_size,
            max_batch_size=self.ctx.config.scheduler.max_batch_size,
            candidate_requests=views(self.cand_requests),
            candidate_batch=views(self.cand_batch),
            current_batch_id=self.current_batch_id,
            now=now(),
        )

    async def boundary(self) -> float:
        """Applies the batch-level scheduling rules through the policy; returns the seconds
        the decision took (the KV moves that carry it out are not counted)."""
        start = now()
        self.running = self.reap(self.running)
        self.cand_requests = self.reap(self.cand_requests)
        self.cand_batch = self.reap(self.cand_batch)
        plan: BoundaryPlan = self.ctx.policy.plan_boundary(self._view())
        decision_time = now() - start
        for seq_id in plan.evict:
            await self.evict(next(s for s in self.running if s.seq_id == seq_id))
        for seq_id in plan.to_pool:
            await self.to_pool(next(s for s in (*self.running, *self.cand_requests)
                                    if s.seq_id == seq_id))
        if plan.admit_batch:
            self.current_batch_id = self.cand_batch_id
        await self.admit(plan.admit_requests, self.cand_requests)
        await self.admit(plan.admit_batch, self.cand_batch)
        if not self.cand_batch:
            self.ask_for_batch()
        return decision_time

    async def evict(self, seq: Sequence) -> None:
        """Running -> candidate requests buffer, else host pool, else recompute later."""
        self.running.remove(seq)
        self.ctx.outputs.event(seq.seq_id, "evicted")
        if await self.move(seq, self.staging):  # a failed copy ends seq with an error
            seq.status = SeqStatus.STAGED
            self.cand_requests.append(seq)
        elif seq.is_finished:
            return
        elif await self.move(seq, "host"):
            seq.status = SeqStatus.POOLED
            assert self.ctx.pool is not None, "disaggregated engine has a pool actor"
            self.ctx.pool.send(Pooled(seq))
        elif not seq.is_finished:  # nowhere to keep the KV: recompute (vLLM's preemption)
            self.ctx.kv.release(seq)
            seq.num_computed_tokens = 0
            target = min(self.ctx.prefill, key=lambda actor: actor.num_waiting_tokens)
            target.send(Submit(seq, front=True))

    async def to_pool(self, seq: Sequence) -> None:
        """A running seq or a candidate request -> host pool, where the policy batches it
        again. If the pool has no room it stays where it was."""
        source, buffer = seq.location, (self.running if seq in self.running
                                        else self.cand_requests)
        if not await self.move(seq, "host"):
            if seq.is_finished:  # the copy failed: seq alone ended with an error
                buffer.remove(seq)
            return
        buffer.remove(seq)
        if buffer is self.running:
            self.ctx.outputs.event(seq.seq_id, "evicted")
        seq.status = SeqStatus.POOLED
        assert self.ctx.pool is not None, "disaggregated engine has a pool actor"
        self.ctx.pool.send(Pooled(seq))
        if source == self.staging and self.ctx.batcher is not None:
            self.ctx.batcher.send(PoolChanged())  # staging room: the batcher may retry

    async def admit(self, seq_ids: tuple[str, ...], buffer: list[Sequence]) -> None:
        """Candidate buffer -> decode cache (a device-to-device copy from staging, or a
        host copy for requests that were never staged)."""
        by_id = {seq.seq_id: seq for seq in buffer}
        freed_host = freed_staging = False
        for seq_id in seq_ids:
            seq = by_id[seq_id]
            source = seq.location
            if not await self.move(seq, self.name):
                if seq.is_finished:  # the copy failed: seq alone ended with an error
                    buffer.remove(seq)
                continue  # no room after all; it stays in its buffer
            buffer.remove(seq)
            freed_host |= source == "host"
            freed_staging |= source == self.staging
            if seq.batch_id < 0:
                seq.batch_id = self.current_batch_id
            if seq.status < SeqStatus.DECODING:
                self.ctx.outputs.event(seq.seq_id, "decode_start")
            seq.status = SeqStatus.DECODING
            self.running.append(seq)
        if freed_host:
            self.ctx.notify_pool_space()
        if freed_staging and self.ctx.batcher is not None:
            self.ctx.batcher.send(PoolChanged())  # staging room: the batcher may retry

    async def iteration(self) -> None:
        schedule_time = await self.boundary()
        runnable = [s for s in self.running if self.ctx.kv.grow(s, s.num_tokens)]
        if not runnable:
            await self.unstick()
            return
        self.report_window(runnable)
        start = now()
        lengths = [s.num_tokens for s in runnable]
        items = [work_item(s, self.ctx.kv.table(s), s.num_tokens - s.num_computed_tokens)
                 for s in runnable]
        result = await self.runner.execute(items, self.store.tensor)
        end = now()
        for seq, token_id, logprob in zip(runnable, result.token_ids, result.logprobs):
            assert token_id is not None, "every decode item samples"
            seq.num_computed_tokens = seq.num_tokens
            if not seq.is_finished:
                self.ctx.outputs.append_token(seq, token_id, logprob, end)
        self.record(start, runnable, lengths, result.forward_time, schedule_time)
        self.running = self.reap(self.running)

    async def unstick(self) -> None:
        """Nothing could run this boundary. With a running batch that cannot grow, evict its
        longest request; with none, wait for the next message instead of spinning."""
        if self.running:
            await self.evict(max(self.running, key=lambda s: s.num_tokens))
        elif self.receive(await self.inbox.get()):
            self.stop()

    def report_window(self, runnable: list[Sequence]) -> None:
        """Tells the batcher the length window of pool requests that could join the running
        batch (the policy's ``prefetch_basis`` and ``prefetch_window``), so they get staged
        while it decodes."""
        current = [s.num_tokens for s in runnable if s.batch_id == self.current_batch_id]
        lengths = self.ctx.policy.prefetch_basis(current, [s.num_tokens for s in runnable])
        if not lengths or self.ctx.batcher is None:
            return
        window = self.ctx.policy.prefetch_window(lengths)
        if window != self.window:
            self.window = window
            # NOTE: room net of what the candidate requests buffer already holds: matching
            # requests beyond what the batch can take would drain the pool into staging,
            # and the next batch would then be chosen from what little is left there.
            held = sum(self.ctx.kv.blocks_for(s.num_computed_tokens) for s in self.cand_requests)
            room = self.store.allocator.num_free - held
            slots = (self.ctx.config.scheduler.max_batch_size - len(self.running)
                     - len(self.cand_requests))
            self.ctx.batcher.send(RunningWindow(self.index, *window, room, slots))

    def record(self, start: float, batch: list[Sequence], lengths: list[int],
               forward_time: float, schedule_time: float) -> None:
        batch_ids = {s.batch_id == self.current_batch_id for s in batch}
        self.ctx.outputs.iteration(IterationRecord(
            instance=self.name, start_time=start, batch_size=len(batch), num_prefill_tokens=0,
            min_len=min(lengths), max_len=max(lengths), forward_time=forward_time,
            schedule_time=schedule_time, is_mixed=len(batch_ids) > 1,
            blocks_used=self.ctx.kv.blocks_used(),
        ))
