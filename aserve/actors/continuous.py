"""ContinuousActor: drives a ColocatedCore (the `continuous` baseline, vLLM / Orca): prefill
and decode on one device, chunked prefill mixed into decode steps, no pool."""

from __future__ import annotations

from aserve.actors.base import Actor, EngineContext
from aserve.cores import ColocatedCore
from aserve.messages import Message, Submit
from scheduler import ContinuousScheduler


class ContinuousActor(Actor):
    """One colocated instance: its core, its KV cache and its model runner."""

    def __init__(self, ctx: EngineContext, index: int) -> None:
        super().__init__(ctx)
        sched = ctx.config.scheduler
        self.core = ColocatedCore(index, ctx.kv, ctx.outputs, ContinuousScheduler(
            sched.max_prefill_tokens, sched.max_batch_size, ctx.kv.block_size))
        self.name = self.core.name
        self.store = ctx.kv[self.name]
        self.runner = ctx.runners[ctx.config.decode_devices[index]]

    @property
    def has_work(self) -> bool:
        return not self.core.is_idle

    def receive(self, message: Message) -> None:
        if isinstance(message, Submit):
            self.core.submit(message.seq, message.front)

    async def act(self) -> None:
        start = self.ctx.now()
        step = self.core.forward(start)
        if step is None:  # nothing fits: wait, never spin
            await self.wait()
            return
        schedule_time = self.ctx.now() - start
        result = await self.forward(step, self.store.tensor, self.runner)
        forks = self.core.finish(step, result.token_ids, result.logprobs, self.ctx.now(),
                                 result.forward_time, schedule_time)
        await self.carry_out_forks(forks, self.core.forked)

    def on_error(self, error: str) -> None:  # the running batch fails, the queue survives
        self.core.fail(error, self.ctx.now())
