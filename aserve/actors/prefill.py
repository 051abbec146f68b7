"""PrefillActor: drives a PrefillCore on one prefill device: packed prefill in the device's
worker thread, then each request's KV is copied to the host pool (backpressure when full)."""

from __future__ import annotations

from aserve.actors.base import Actor, EngineContext
from aserve.core import SeqStatus
from aserve.cores import PrefillCore, Wiring
from aserve.messages import Message, Submit


class PrefillActor(Actor):
    """One prefill instance: its core, its scratch KV store and its model runner."""

    def __init__(self, ctx: EngineContext, index: int, wiring: Wiring) -> None:
        super().__init__(ctx)
        self.core = PrefillCore(index, ctx.kv, ctx.outputs, wiring,
                                ctx.config.scheduler.max_prefill_tokens)
        self.name = self.core.name
        self.store = ctx.kv[self.name]
        self.runner = ctx.runners[ctx.config.prefill_devices[index]]

    @property
    def has_work(self) -> bool:
        return self.core.can_prefill

    def receive(self, message: Message) -> None:
        if isinstance(message, Submit):
            self.core.submit(message.seq, message.front)

    async def act(self) -> None:
        if not await self.offload() or not self.core.can_prefill:
            return
        step = self.core.forward(self.ctx.now())
        if step is None:
            return
        try:
            result = await self.forward(step, self.store.tensor, self.runner)
        except Exception as exc:
            self.core.fail(step, self.record_error(exc), self.ctx.now())
            return
        forks = self.core.finish(step, result.token_ids, result.logprobs, self.ctx.now(),
                                 result.forward_time)
        await self.carry_out_forks(forks, self.core.forked)
        await self.offload()

    async def offload(self) -> bool:
        """Copies prefilled KV to the host pool, in order; False while the pool is full."""
        life = self.ctx.outputs
        while (move := self.core.next_offload(self.ctx.now())) is not None:
            await self.carry_out(move, self.core.landed,
                                 lambda m, error, t: life.fail_move(m, error, at=t))
        return not self.core.blocked

    def on_error(self, error: str) -> None:
        for seq in self.core.blocked:
            self.ctx.outputs.finish(seq, SeqStatus.FINISHED_ERROR, error, at=self.ctx.now())
        self.core.blocked.clear()
