"""The Ray driver of the scheduling cores: the engine's asyncio actor loop (one per
instance, aserve/engine/actors.py), with each forward run by the instance's NodeWorker on
its node and each KV move carried out by the workers holding its stores, within a node on
its copy path and between nodes by the inter-node transport (transport/remote.py). The
decisions stay the cores'; the block tables stay in the front end's BlockLedger.

A worker whose calls fail (its node died) takes its instance offline: what the instance
held ends with a `NodeLost` error, its staged candidates go back to the host pool, and it
takes no batch until its worker answers again (Ray restarts it on a node that joins).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from aserve.cores import BlockLedger, Core, Move
from aserve.cores.decode import DecodeCore
from aserve.engine.actors import Actor, EngineContext, work_item
from aserve.engine.errors import NodeLost
from aserve.engine.runner import StepResult
from aserve.engine.sequence import SeqStatus
from transport.remote import InterNodeTransport

if TYPE_CHECKING:
    from aserve.cores import Forward

logger = logging.getLogger(__name__)
PING_TIMEOUT_S = 2.0  # seconds a worker has to answer a liveness call
RETRY_S = 1.0  # seconds between an offline instance's calls to its worker


class RayKVSpace(BlockLedger):
    """The engine's block tables (every store of every node) and the copies that carry out
    its moves: a hand-over within one tensor, a copy by the worker holding both stores, or
    the inter-node transport between two workers."""

    def __init__(self, layout: Mapping[str, tuple[str, int]], block_size: int,
                 share_memory: bool, holders: Mapping[str, str], workers: Mapping[str, Any],
                 transport: InterNodeTransport) -> None:
        """`layout`: every store (`kv_stores`), its device named per worker so that stores
        of different workers never share a tensor; `holders`: the worker of each store."""
        super().__init__(layout, block_size, share_memory)
        self.holders, self.workers, self.transport = holders, workers, transport
        self.on_lost: Callable[[str, BaseException], NodeLost] = _node_lost

    async def copy(self, move: Move, clock: Callable[[], float]) -> None:
        """Copies a reserved move's KV and commits it (as KVSpace.copy). A worker that
        fails is reported lost, and the copy raises NodeLost with nothing committed."""
        if move.handover:
            now = clock()
            self.commit(move, now, now)
            return
        start = clock()
        await self.transfer(move)
        self.commit(move, start, clock())

    async def transfer(self, move: Move) -> None:
        """The copy of a move that is not a hand-over, on the workers; nothing committed."""
        src_ids, dst_ids = self.tables(move)
        src, dst = self.holders[move.src], self.holders[move.dst]
        try:
            if src == dst:
                await self.workers[src].copy_blocks.remote(move.src, src_ids, move.dst, dst_ids)
            else:
                await self.transport.send(self.workers[src], move.src, src_ids,
                                          self.workers[dst], move.dst, dst_ids)
        except Exception as exc:
            lost = [w for w in dict.fromkeys((dst, src)) if not await answers(self.workers[w])]
            if not lost:
                raise
            raise self.on_lost(lost[0], exc) from exc

    def used_by_worker(self) -> dict[str, dict[str, int]]:
        """Blocks in use in each store, grouped by the worker holding it."""
        out: dict[str, dict[str, int]] = {}
        for store, worker in self.holders.items():
            out.setdefault(worker, {})[store] = self.allocators[store].num_used
        return out


class RayActor(Actor):
    """One instance's driver in the front end: the asyncio actor's loop, with the forward
    run by the instance's worker. While its worker is lost it is offline (see the module)."""

    def __init__(self, ctx: EngineContext, core: Core, device: str | None,
                 reopen: Callable[[str], Any]) -> None:
        super().__init__(ctx, core, None)
        self.device = device  # after Actor's: it has no local runner
        self.reopen = reopen  # re-opens a restarted worker's stores
        self.offline: str | None = None  # why, while its worker is lost
        self._asked = 0.0  # when it last asked its lost worker whether it is back
        self.num_calls = 0  # forwards run on the worker
        self.call_overhead = 0.0  # seconds of them outside the worker's forward (RPC, pickling)

    @property
    def worker(self) -> Any:
        return self.ctx.kv.workers[self.name]  # type: ignore[attr-defined]

    async def act(self) -> None:
        if self.offline is None:
            await super().act()
        else:
            await self._while_offline()

    async def forward(self, step: Forward) -> StepResult:
        items = [work_item(s, self.ctx.kv.table(s), n)
                 for s, n in zip(step.seqs, step.num_new_tokens)]
        began = time.perf_counter()
        try:
            result, written = await self.worker.execute.remote(self.name, items)
        except Exception as exc:
            if await answers(self.worker):
                raise
            raise self.ctx.kv.on_lost(self.name, exc) from exc  # type: ignore[attr-defined]
        for item, out in zip(items, written):  # prompt logprobs the worker wrote
            if item.prompt_logprobs is not None and out is not None:
                item.prompt_logprobs.out[:] = out
        self.num_calls += 1
        self.call_overhead += time.perf_counter() - began - result.forward_time
        return result

    def go_offline(self, error: str) -> None:
        if self.offline is None:
            logger.error("%s is offline: %s", self.name, error)
            self.offline = error
            self._asked = self.ctx.clock()
            self.core.is_offline = True
            if isinstance(self.core, DecodeCore):
                self.core.wants_batch = False
                if self.ctx.wiring.batcher is not None:
                    self.ctx.wiring.batcher.core.forget_window(self.core.index)
        self.wake()

    async def _while_offline(self) -> None:
        """Ends what the instance holds (its waiting requests, which hold no KV yet, go to
        an entry instance online if there is one), returns its staged candidates to the
        pool, and every RETRY_S asks its worker whether it is back."""
        now = self.ctx.clock()
        assert self.offline is not None
        self.core.fail(self.offline, now)
        if isinstance(self.core, DecodeCore):
            for move in self.core.release_candidates(now):
                await self.carry_out(move)
        else:
            waiting = list(self.core.waiting)
            self.core.waiting.clear()
            wiring = self.ctx.wiring
            online = any(not d.core.is_offline for d in wiring.prefills or wiring.decodes)
            for seq in waiting:
                if online:
                    wiring.submit(seq, front=True)
                else:
                    self.ctx.life.finish(seq, SeqStatus.FINISHED_ERROR, self.offline, at=now)
        wait = self._asked + RETRY_S - self.ctx.clock()
        if wait > 0:  # woken meanwhile: end what arrived first
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._woken.wait(), wait)
            return
        self._asked = self.ctx.clock()
        if await answers(self.worker):
            await self.reopen(self.name)
            logger.info("%s is back", self.name)
            self.offline = None
            self.core.is_offline = False
            if isinstance(self.core, DecodeCore):
                self.core.ask_for_batch()


async def answers(worker: Any) -> bool:
    """Whether `worker` answers a liveness call within PING_TIMEOUT_S."""
    try:
        await asyncio.wait_for(worker.ping.remote(), PING_TIMEOUT_S)
    except Exception:
        return False
    return True


def _node_lost(worker: str, exc: BaseException) -> NodeLost:
    return NodeLost(f"the node of {worker} is lost: {type(exc).__name__}: {exc}")
