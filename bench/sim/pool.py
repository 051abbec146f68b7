"""Simulated host KV pool and batch generator (aserve/actors/pool.py and batcher.py).

The pool indexes pooled requests through the real policy object. The batcher asks it for
the next batch whenever a decode instance's candidate batch buffer is empty, and for
requests matching a running batch's length window (dynamic prefetch), and prefetches their
KV into the instance's staging buffer over the prefill device's host link; a request the
staging buffer cannot take stays in host memory.

NOTE: prefetches for different instances overlap (each link queues its own copies), as in
the paper. The engine's BatcherActor awaits each prefetch before the next decision, which
at paper scale would make one PCIe link the bound of the whole cluster.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, NamedTuple

from bench.sim.cluster import SimContext
from bench.sim.loop import POOLED, STAGED, SimActor, SimSeq, Store
from scheduler import SeqView

if TYPE_CHECKING:
    from bench.sim.prefill import PrefillInstance

MATCH_STAGING_SHARE = 0.5  # at most this share of free staging goes to matching requests

Deliver = Callable[[int, list[SimSeq]], None]


class Pool:
    """The host pool's bookkeeping: pooled sequences, indexed by the policy."""

    def __init__(self, ctx: SimContext) -> None:
        self.ctx = ctx
        self.host = ctx.store("host", "host", ctx.config.num_host_blocks)
        self.seqs: dict[str, SimSeq] = {}
        self.prefills: list[PrefillInstance] = []
        self.batcher: Batcher | None = None

    def __len__(self) -> int:
        return len(self.seqs)

    def add(self, seq: SimSeq) -> None:
        """`seq`'s KV has landed in host memory: index it and tell the batcher."""
        assert seq.location is self.host, f"{seq.seq_id} pooled without host KV"
        seq.status = POOLED
        self.ctx.recorder.event(seq, "pooled", self.ctx.loop.now)
        self.seqs[seq.seq_id] = seq
        num_blocks = self.ctx.stores.blocks_for(seq.num_computed)
        view = SeqView(seq.seq_id, seq.num_tokens, num_blocks, seq.arrival_time, seq.batch_id,
                       waiting_since=seq.last_token_time)
        start = time.perf_counter()
        self.ctx.policy.add(view)
        self.ctx.policy_time += time.perf_counter() - start
        assert self.batcher is not None, "the pool is wired to a batcher"
        self.batcher.pool_changed()

    def take(self, seq_ids: list[str]) -> list[SimSeq]:
        """Removes `seq_ids` from the pool and hands them over."""
        taken = [self.seqs.pop(seq_id) for seq_id in seq_ids]
        start = time.perf_counter()
        for seq_id in seq_ids:
            self.ctx.policy.remove(seq_id)
        self.ctx.policy_time += time.perf_counter() - start
        return taken

    def notify_space(self) -> None:
        """Host blocks were freed: wake prefill instances held back by a full pool."""
        for prefill in self.prefills:
            if prefill.blocked:
                prefill.wake()


class Window(NamedTuple):
    """A decode instance's running length window, for dynamic prefetch."""

    lo: int
    hi: int
    max_blocks: int  # decode room the instance can accept
    max_requests: int


class Batcher(SimActor):
    """Forms candidate batches and fills candidate request buffers."""

    def __init__(self, ctx: SimContext, pool: Pool) -> None:
        super().__init__(ctx.loop)
        self.ctx, self.pool = ctx, pool
        self.wanting: set[int] = set()
        self.in_flight: set[int] = set()  # instances whose next batch is being prefetched
        self.windows: dict[int, Window] = {}
        self.pending: set[int] = set()  # instances whose window wants a matching pass
        self.staging: list[Store] = []  # by decode instance
        self.deliver_batch: list[Deliver] = []  # by decode instance
        self.deliver_requests: list[Deliver] = []
        self.num_batches = 0

    def want(self, instance: int) -> None:
        """An instance's candidate batch buffer is empty.

        NOTE: a want while that instance's batch is still being prefetched only wakes the
        batcher; taking a second batch then would overwrite the first on delivery.
        """
        if instance not in self.in_flight:
            self.wanting.add(instance)
        self.wake()

    def pool_changed(self) -> None:
        if self.ctx.policy.uses_dynamic_prefetch:
            self.pending.update(self.windows)
        self.wake()

    def window(self, instance: int, window: Window) -> None:
        self.windows[instance] = window
        self.pending.add(instance)
        self.wake()

    def act(self) -> None:
        """Batches for every waiting instance the pool can serve, then matching requests."""
        while self._fill_one():
            pass
        while self.pending:
            instance = min(self.pending)
            self.pending.discard(instance)
            self._match(instance)

    def _fill_one(self) -> bool:
        """Gives one waiting decode instance a batch, if the pool has one for it."""
        cfg, policy = self.ctx.config, self.ctx.policy
        for instance in sorted(self.wanting):
            if not len(self.pool):
                return False
            # NOTE: as in the engine (aserve/actors/batcher.py), the budget is a share of the
            # decode cache, not capped by free staging: what the staging buffer cannot take
            # stays in the host pool and is copied straight to decode when admitted; when only
            # requests above the share are pooled, one of them gets the whole cache.
            start = time.perf_counter()
            seq_ids = policy.next_batch(int(cfg.num_decode_blocks * cfg.batch_kv_fraction),
                                        cfg.max_batch_size, self.ctx.loop.now)
            if not seq_ids:
                seq_ids = policy.next_batch(cfg.num_decode_blocks, cfg.max_batch_size,
                                            self.ctx.loop.now)
            self.ctx.policy_time += time.perf_counter() - start
            if not seq_ids:
                continue
            self.wanting.discard(instance)
            self.in_flight.add(instance)
            self.num_batches += 1
            seqs = self.pool.take(seq_ids)
            self._stage(seqs, instance, self.num_batches, self._deliver_batch)
            return True
        return False

    def _match(self, instance: int) -> bool:
        """Stages pool requests whose length lies in the instance's running window."""
        window = self.windows.get(instance)
        if window is None or not self.ctx.policy.uses_dynamic_prefetch or not len(self.pool):
            return False
        room = min(int(self.staging[instance].num_free * MATCH_STAGING_SHARE), window.max_blocks)
        if room <= 0 or window.max_requests <= 0:
            return False
        start = time.perf_counter()
        seq_ids = self.ctx.policy.matching(window.lo, window.hi, room, window.max_requests,
                                           self.ctx.loop.now)
        self.ctx.policy_time += time.perf_counter() - start
        if not seq_ids:
            return False
        self._stage(self.pool.take(seq_ids), instance, -1, self.deliver_requests[instance])
        return True

    def _stage(self, seqs: list[SimSeq], instance: int, batch_id: int,
               deliver: Deliver) -> None:
        """Prefetches `seqs` host -> staging one after another (each copy starts when the
        previous lands, as the engine awaits each move), then delivers them all at once."""
        for seq in seqs:
            seq.instance, seq.batch_id = instance, batch_id
        self._stage_from(seqs, 0, instance, deliver, False)

    def _stage_from(self, seqs: list[SimSeq], index: int, instance: int, deliver: Deliver,
                    moved_any: bool) -> None:
        ctx = self.ctx
        batch_id = seqs[0].batch_id if seqs else -1
        while index < len(seqs):
            seq = seqs[index]
            index += 1
            num_blocks = ctx.stores.move(seq, self.staging[instance]) \
                if ctx.policy.uses_staging else 0
            if num_blocks:
                device = ctx.config.prefill_devices[instance % len(ctx.config.prefill_devices)]
                done = ctx.copy(ctx.host_link(device, "h2d"), ctx.loop.now, num_blocks)
                seq.status = STAGED
                ctx.recorder.event(seq, "prefetched", done)
                ctx.loop.at(done, partial(self._stage_from, seqs, index, instance, deliver,
                                          True))
                return
        self._delivered(deliver, batch_id, seqs, moved_any)

    def _deliver_batch(self, batch_id: int, seqs: list[SimSeq]) -> None:
        instance = seqs[0].instance
        self.in_flight.discard(instance)
        self.deliver_batch[instance](batch_id, seqs)

    def _delivered(self, deliver: Deliver, batch_id: int, seqs: list[SimSeq],
                   freed_host: bool) -> None:
        if freed_host:
            self.pool.notify_space()
        deliver(batch_id, seqs)
