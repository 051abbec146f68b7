"""DecodeActor: drives a DecodeCore on one decode device. Each iteration: boundary (the
policy's plan) -> its KV copies, awaited in order -> the forward in the device's worker
thread -> one token per running request."""

from __future__ import annotations

from aserve.actors.base import Actor, EngineContext
from aserve.cores import DecodeCore, Move, Wiring
from aserve.messages import Deliver, Message


class DecodeActor(Actor):
    """One decode instance: its core, its KV cache and its model runner."""

    def __init__(self, ctx: EngineContext, index: int, wiring: Wiring) -> None:
        super().__init__(ctx)
        self.core = DecodeCore(index, ctx.policy, ctx.kv, ctx.outputs, wiring,
                               ctx.config.scheduler.max_batch_size)
        self.name = self.core.name
        self.store = ctx.kv[self.name]
        self.runner = ctx.runners[ctx.config.decode_devices[index]]

    @property
    def has_work(self) -> bool:
        return not self.core.is_idle

    async def run(self) -> None:
        self.core.ask_for_batch()
        await super().run()

    def receive(self, message: Message) -> None:
        if isinstance(message, Deliver):
            self.core.receive(message.batch_id, message.seqs)

    async def act(self) -> None:
        if self.core.is_idle:
            return
        start = self.ctx.now()
        moves = self.core.boundary(start)
        schedule_time = self.ctx.now() - start  # the decision, not the copies carrying it out
        await self.carry_out_all(moves)
        step = self.core.forward(self.ctx.now())
        if isinstance(step, list):  # nothing could run: an eviction, or wait for a batch
            await self.carry_out_all(step)
            if not step:
                await self.wait()
            return
        result = await self.forward(step, self.store.tensor, self.runner)
        self.core.finish(step, result.token_ids, result.logprobs, self.ctx.now(),
                         result.forward_time, schedule_time)

    async def carry_out_all(self, moves: list[Move]) -> None:
        """Copies `moves`, then the admissions the core asks for once they landed."""
        while True:
            for move in moves:
                await self.carry_out(move, self.core.landed, self.core.failed)
            moves = self.core.settled(self.ctx.now())
            if not moves:
                return

    def on_error(self, error: str) -> None:  # the running batch fails, the buffers survive
        self.core.fail(error, self.ctx.now())
