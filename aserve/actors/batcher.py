"""BatcherActor: drives the BatcherCore (host pool + batch generator). Pool bookkeeping is
applied as messages arrive; the loop stages each order's KV into the decode instance's
staging buffer on the prefill device (host -> device copies), then delivers it."""

from __future__ import annotations

from functools import partial

from aserve.actors.base import Actor, EngineContext
from aserve.core import SeqStatus
from aserve.cores import BatcherCore, Order, Wiring
from aserve.messages import Message, Pooled, RunningWindow, Wake, WantBatch


class BatcherActor(Actor):
    """Forms candidate batches and fills candidate request buffers."""

    name = "batcher"

    def __init__(self, ctx: EngineContext, wiring: Wiring) -> None:
        super().__init__(ctx)
        sched = ctx.config.scheduler
        self.core = BatcherCore(ctx.policy, ctx.kv, ctx.outputs, wiring,
                                ctx.config.cache.num_decode_blocks, sched.batch_kv_fraction,
                                sched.max_batch_size)
        self.order: Order | None = None  # the order being staged

    def send(self, message: Message) -> None:
        """NOTE: the pool's bookkeeping is applied as messages arrive, never queued behind a
        staging copy (the loop only stages and delivers)."""
        if isinstance(message, Pooled):
            self.core.add(message.seq)
        elif isinstance(message, WantBatch):
            self.core.want(message.instance)
        elif isinstance(message, RunningWindow):
            self.core.report_window(message.instance, message.window)
        elif isinstance(message, Wake):
            self.core.pool_changed()
        super().send(message)

    async def act(self) -> None:
        while (order := self.core.next_order(self.ctx.now())) is not None:
            self.order = order
            await self.stage(order)
            self.order = None

    async def stage(self, order: Order) -> None:
        """Prefetches `order` seq by seq (host -> staging), then delivers it."""
        life = self.ctx.outputs
        while (move := self.core.next_move(order, self.ctx.now())) is not None:
            await self.carry_out(move, partial(self.core.landed, order),
                                 lambda m, error, t: life.fail_move(m, error, at=t))
        self.core.deliver(order, self.ctx.now())

    def on_error(self, error: str) -> None:
        if self.order is not None:
            for seq in self.order.seqs:
                self.ctx.outputs.finish(seq, SeqStatus.FINISHED_ERROR, error, at=self.ctx.now())
            self.core.in_flight.discard(self.order.instance)
            self.order = None
