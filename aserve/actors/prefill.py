"""PrefillActor: packed prefill on one prefill device, then the KV goes to the host pool.

Prefill samples each request's first token (its TTFT). When the host pool is full the
prefilled KV waits in the scratch cache and no new prefill starts (backpressure).
"""

from __future__ import annotations

import logging
from collections import deque

from aserve.actors.base import Actor, EngineContext, now, work_item
from aserve.core import IterationRecord, SeqStatus, Sequence
from aserve.messages import Abort, Message, Pooled, Stop, Submit

logger = logging.getLogger(__name__)


class PrefillActor(Actor):
    """One prefill instance: a waiting queue, a scratch KV store and a model runner."""

    def __init__(self, ctx: EngineContext, index: int) -> None:
        super().__init__(ctx)
        self.index = index
        self.name = f"prefill{index}"
        self.store = ctx.kv[self.name]
        self.runner = ctx.runners[ctx.config.prefill_devices[index]]
        self.waiting: deque[Sequence] = deque()
        self.blocked: deque[Sequence] = deque()  # prefilled; waiting for host-pool room

    @property
    def num_waiting_tokens(self) -> int:
        return sum(seq.num_tokens for seq in self.waiting)

    async def run(self) -> None:
        while True:
            if not self.waiting or self.blocked:
                if self.receive(await self.inbox.get()):
                    return
            while not self.inbox.empty():
                if self.receive(self.inbox.get_nowait()):
                    return
            try:
                await self.offload_blocked()
                if self.waiting and not self.blocked:
                    await self.step()
            except Exception as exc:  # boundary: fail what this actor holds, keep serving
                self.fail([*self.blocked], self.record_error(exc))
                self.blocked.clear()

    def receive(self, message: Message) -> bool:
        """Takes one message; returns True on Stop."""
        if isinstance(message, Stop):
            return True
        if isinstance(message, Submit):
            message.seq.status = SeqStatus.WAITING
            (self.waiting.appendleft if message.front else self.waiting.append)(message.seq)
        elif isinstance(message, Abort):
            self.waiting = deque(self.reap(list(self.waiting)))
        return False

    def _take_batch(self) -> list[Sequence]:
        """Pops waiting sequences up to the token budget whose KV fits the scratch store."""
        budget = self.ctx.config.scheduler.max_prefill_tokens
        batch: list[Sequence] = []
        while self.waiting:
            seq = self.waiting[0]
            if batch and seq.num_tokens > budget:
                break
            if not self.ctx.kv.allocate(seq, self.name, seq.num_tokens):
                break
            batch.append(self.waiting.popleft())
            budget -= seq.num_tokens
        return batch

    async def step(self) -> None:
        self.waiting = deque(self.reap(list(self.waiting)))
        batch = self._take_batch()
        if not batch:
            if self.waiting and not self.blocked:  # admission control makes this a bug
                self.fail([self.waiting.popleft()], "prompt does not fit the prefill KV store")
            return
        start = now()
        for seq in batch:
            seq.status = SeqStatus.PREFILLING
            self.ctx.outputs.event(seq.seq_id, "prefill_start", start)
        items = [work_item(seq, self.ctx.kv.table(seq), seq.num_tokens) for seq in batch]
        try:
            result = await self.runner.execute(items, self.store.tensor)
        except Exception as exc:
            self.fail(batch, self.record_error(exc))
            return
        end = now()
        lengths = tuple(seq.num_tokens for seq in batch)
        self.ctx.outputs.prefill_iteration(IterationRecord(
            instance=self.name, start_time=start, batch_size=len(batch),
            num_prefill_tokens=sum(lengths), min_len=min(lengths), max_len=max(lengths),
            forward_time=result.forward_time, schedule_time=0.0, is_mixed=False,
            blocks_used=self.ctx.kv.blocks_used(), prefill_lengths=lengths))
        for seq, token_id, logprob in zip(batch, result.token_ids, result.logprobs):
            assert token_id is not None, "prefill of a whole sequence always samples"
            seq.num_computed_tokens = seq.num_tokens
            self.ctx.outputs.event(seq.seq_id, "prefill_end", end)
            forked, unforked = await self.spawn_forks(seq)
            self.blocked.extend(forked)
            self.waiting.extendleft(reversed(unforked))
            self.ctx.outputs.append_token(seq, token_id, logprob, end)
            if seq.is_finished:
                self.ctx.kv.release(seq)
            else:
                self.blocked.append(seq)
        await self.offload_blocked()

    async def offload_blocked(self) -> None:
        """Moves prefilled KV to the host pool, in order, until the pool is full."""
        while self.blocked:
            seq = self.blocked[0]
            if self.reap([seq]) and not await self.move(seq, "host") and not seq.is_finished:
                return  # the host pool is full: wait for PoolSpace
            self.blocked.popleft()
            if seq.is_finished:
                continue
            seq.status = SeqStatus.POOLED
            self.ctx.outputs.event(seq.seq_id, "pooled")
            assert self.ctx.pool is not None, "disaggregated engine has a pool actor"
            self.ctx.pool.send(Pooled(seq))
