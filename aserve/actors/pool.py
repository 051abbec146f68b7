"""PoolActor: owns the sequences whose KV sits in the host pool, and the policy's index.

It adds and removes pool entries through the policy and hands sequences over to the
batcher on request. It never copies KV itself.
"""

from __future__ import annotations

from aserve.actors.base import Actor, EngineContext, now, seq_view
from aserve.core import Sequence
from aserve.messages import Abort, Message, PoolChanged, Pooled, PoolSpace, TakeBatch, TakeMatching


class PoolActor(Actor):
    """The host KV pool's bookkeeping: which sequences it holds, indexed by the policy."""

    name = "pool"

    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx)
        self.seqs: dict[str, Sequence] = {}

    def __len__(self) -> int:
        return len(self.seqs)

    async def handle(self, message: Message) -> None:
        if isinstance(message, Pooled):
            self.add(message.seq)
        elif isinstance(message, Abort):
            seq = self.seqs.get(message.seq_id)
            if seq is not None and not self.reap([seq]):
                self._remove(seq)
                self.ctx.notify_pool_space()
        elif isinstance(message, TakeBatch):
            ids = self.ctx.policy.next_batch(message.max_blocks, message.max_requests, now())
            message.reply.set_result(self._take(ids))
        elif isinstance(message, TakeMatching):
            ids = self.ctx.policy.matching(message.lo, message.hi, message.max_blocks,
                                           message.max_requests, now())
            message.reply.set_result(self._take(ids))

    def add(self, seq: Sequence) -> None:
        assert seq.location == "host", f"{seq.seq_id} pooled without host KV ({seq.location})"
        self.seqs[seq.seq_id] = seq
        self.ctx.policy.add(seq_view(seq, self.ctx.kv.blocks_for(seq.num_computed_tokens)))
        assert self.ctx.batcher is not None, "disaggregated engine has a batcher"
        self.ctx.batcher.send(PoolChanged())

    def _remove(self, seq: Sequence) -> None:
        del self.seqs[seq.seq_id]
        self.ctx.policy.remove(seq.seq_id)

    def _take(self, ids: list[str]) -> list[Sequence]:
        """Removes `ids` from the pool and hands over the live ones."""
        taken = [self.seqs[i] for i in ids]
        for seq in taken:
            self._remove(seq)
        live = self.reap(taken)
        if len(live) < len(taken):
            self.ctx.notify_pool_space()
        return live


__all__ = ["PoolActor", "PoolSpace"]
