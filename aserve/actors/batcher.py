"""BatcherActor: asks the pool for the next batch whenever a decode instance's candidate
batch buffer is empty, prefetches its KV into that instance's staging buffer on the prefill
device (overlapping the running decode iterations), and dynamically prefetches pool requests
that match a running batch's length window. The choice itself is the policy's.
"""

from __future__ import annotations

import asyncio

import msgspec

from aserve.actors.base import Actor, EngineContext
from aserve.core import SeqStatus, Sequence
from aserve.messages import (
    CandidateBatch,
    CandidateRequests,
    Message,
    PoolChanged,
    RunningWindow,
    TakeBatch,
    TakeMatching,
    WantBatch,
)

MATCH_STAGING_SHARE = 0.5  # at most this share of free staging goes to matching requests


class BatcherActor(Actor):
    """Forms candidate batches and fills candidate request buffers."""

    name = "batcher"

    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx)
        self.wanting: set[int] = set()
        self.windows: dict[int, RunningWindow] = {}
        self.num_batches = 0
        self.holding: list[Sequence] = []  # sequences in flight through this actor

    async def handle(self, message: Message) -> None:
        try:
            if isinstance(message, WantBatch):
                self.wanting.add(message.instance)
                await self.fill()
            elif isinstance(message, PoolChanged):
                await self.fill()
                for instance in list(self.windows):
                    await self.prefetch_matching(instance)
            elif isinstance(message, RunningWindow):
                self.windows[message.instance] = message
                await self.prefetch_matching(message.instance)
        except Exception as exc:
            self.fail(self.holding, self.record_error(exc))
            self.holding = []

    def _batch_budget(self) -> int:
        """Blocks a new batch may hold: a share of the decode cache. NOTE: not capped by free
        staging; what does not fit the staging buffer stays in the host pool and is copied
        straight to the decode device when admitted, so no request is too big to batch."""
        config = self.ctx.config
        return int(config.cache.num_decode_blocks * config.scheduler.batch_kv_fraction)

    async def fill(self) -> None:
        """Gives every waiting decode instance a batch, while the pool has one."""
        assert self.ctx.pool is not None, "disaggregated engine has a pool actor"
        for instance in sorted(self.wanting):
            if not len(self.ctx.pool):
                return
            self.holding = await self._take(self._batch_budget())
            if not self.holding:  # only requests above the share: give one the whole cache
                self.holding = await self._take(self.ctx.config.cache.num_decode_blocks)
            if not self.holding:
                continue
            self.num_batches += 1
            seqs = await self._stage(self.holding, instance, self.num_batches)
            self.holding = []
            if seqs:  # NOTE: none left (aborted or failed while staged): the instance waits on
                self.wanting.discard(instance)
                self.ctx.decode[instance].send(CandidateBatch(self.num_batches, seqs))

    async def _take(self, max_blocks: int) -> list[Sequence]:
        assert self.ctx.pool is not None, "disaggregated engine has a pool actor"
        reply: asyncio.Future[list[Sequence]] = asyncio.get_running_loop().create_future()
        self.ctx.pool.send(TakeBatch(max_blocks, self.ctx.config.scheduler.max_batch_size, reply))
        return await reply

    async def prefetch_matching(self, instance: int) -> None:
        """Stages pool requests whose length lies in the instance's running window."""
        window = self.windows.get(instance)
        if not self.ctx.policy.uses_dynamic_prefetch or window is None:
            return
        assert self.ctx.pool is not None, "disaggregated engine has a pool actor"
        room = int(self.ctx.kv.free_blocks(f"staging{instance}") * MATCH_STAGING_SHARE)
        room = min(room, window.max_blocks)
        if room <= 0 or window.max_requests <= 0 or not len(self.ctx.pool):
            return
        reply: asyncio.Future[list[Sequence]] = asyncio.get_running_loop().create_future()
        self.ctx.pool.send(TakeMatching(window.lo, window.hi, room, window.max_requests, reply))
        self.holding = await reply
        if self.holding:  # this window's room is spent until the instance reports again
            taken = sum(self.ctx.kv.blocks_for(s.num_computed_tokens) for s in self.holding)
            self.windows[instance] = msgspec.structs.replace(
                window, max_blocks=window.max_blocks - taken,
                max_requests=window.max_requests - len(self.holding))
            seqs = await self._stage(self.holding, instance, -1)
            self.holding = []
            self.ctx.decode[instance].send(CandidateRequests(seqs))

    async def _stage(self, seqs: list[Sequence], instance: int, batch_id: int) -> list[Sequence]:
        """Prefetches `seqs` into the instance's staging buffer (host -> prefill device).

        A sequence the staging buffer cannot take stays in the host pool and is copied
        straight to the decode device when admitted (also the `aligned-noprefetch` path).
        """
        staging = f"staging{instance}"
        moved_any = False
        for seq in seqs:
            seq.instance, seq.batch_id = instance, batch_id
            if self.ctx.policy.uses_staging and self.reap([seq]):
                if await self.move(seq, staging):  # a failed copy fails seq alone
                    moved_any = True
                    seq.status = SeqStatus.STAGED
                    self.ctx.outputs.event(seq.seq_id, "prefetched")
        if moved_any:
            self.ctx.notify_pool_space()
        return self.reap(seqs)
