"""The state machine of the host pool and batch generator."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aserve.cores.base import (
    BatcherMessage,
    Core,
    Move,
    Pooled,
    StagingFreed,
    WantsBatch,
    Window,
    WindowReport,
    seq_views,
)
from aserve.engine.sequence import SeqState, SeqStatus

MATCH_STAGING_SHARE = 0.5  # at most this share of free staging goes to matching requests


# -- batcher --------------------------------------------------------------------------
# BatcherCore: the host pool (its sequences, indexed by the policy) and the batch
# generator. Whenever a decode instance's candidate batch buffer is empty it takes the
# policy's next batch from the pool; it also takes pool requests matching a running batch's
# length window (dynamic prefetch). Each order is staged seq by seq into the instance's
# staging buffer on the prefill device, then delivered. The choices are the policy's.


@dataclass(slots=True)
class Order:
    """Seqs taken from the pool for one decode instance: its next candidate batch, or
    candidate requests (batch_id < 0); staged one by one (`index`), then delivered."""

    instance: int
    batch_id: int
    seqs: list[SeqState]
    index: int = 0
    moved: list[SeqState] = field(default_factory=list)
    moving: Move | None = None  # its copy in flight


class BatcherCore(Core):
    """Pooled seqs, the decode instances waiting for a batch, and their running windows."""

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx, "batcher")
        self.num_decode_blocks = self.kv.allocators["decode0"].num_blocks
        # NOTE: a batch's budget is a share of the decode cache, not capped by free staging:
        # what the staging buffer cannot take stays in the host pool and is copied straight
        # to decode when admitted, so no request is too big to batch.
        self.batch_blocks = int(self.num_decode_blocks * self.sched.batch_kv_fraction)
        self.policy.batch_room = (self.batch_blocks, self.sched.max_batch_size)
        self.seqs: dict[str, SeqState] = {}
        self.windows: dict[int, Window] = {}
        self.pending: set[int] = set()  # instances whose window wants a matching pass
        self.num_batches = 0
        self.orders: list[Order] = []  # being staged
        config = ctx.config
        # prefill instances on a device a decode instance also runs on (`incoming`)
        self.shared_prefills = [i for i, dev in enumerate(config.prefill_devices)
                                if dev in config.decode_devices]

    def step(self, now: float) -> list[Move] | None:
        """The next staging copy of an order whose last copy has landed (an order all
        staged is delivered), else the first of a new order; None when there is nothing to
        do. A driver may copy for several orders at once (each link queues its own)."""
        while True:
            order = next((o for o in self.orders if o.moving is None), None)
            if order is None:
                if (order := self.next_order(now)) is None:
                    return None
                self.orders.append(order)
            order.moving = self.next_move(order, now)
            if order.moving is not None:
                return [order.moving]
            self.orders.remove(order)
            self.deliver(order, now)

    def _landing(self, move: Move) -> Order:
        order = next(o for o in self.orders if o.moving is move)
        order.moving = None
        return order

    def failed(self, move: Move, error: str, now: float) -> None:
        self._landing(move)
        super().failed(move, error, now)

    def fail(self, error: str, now: float) -> None:
        """The orders being staged end with an error."""
        for order in self.orders:
            self.life.fail_all(order.seqs, error, now)
        self.orders = []

    def receive(self, message: BatcherMessage) -> None:
        """A message from another core (`Wiring.to_batcher`)."""
        match message:
            case Pooled(seq):
                self.add(seq)
            case WindowReport(instance, window):
                self.report_window(instance, window)
            case StagingFreed():
                self.pool_changed()
            case WantsBatch():
                pass  # `next_order` reads each decode core's `wants_batch`

    def add(self, seq: SeqState) -> None:
        """`seq`'s KV landed in the host pool: it is pooled, indexed by the policy."""
        assert seq.location == "host", f"{seq.seq_id} pooled without host KV ({seq.location})"
        self.life.transition(seq, SeqStatus.POOLED)
        self.seqs[seq.seq_id] = seq
        self.policy.add(seq_views([seq], self.kv)[0])
        self.pool_changed()

    def pool_changed(self) -> None:
        """The pool gained requests or staging room was freed: windows may match again
        (only a policy with dynamic prefetch has windows reported)."""
        self.pending.update(self.windows)

    def reap(self, now: float) -> None:
        """Ends the pooled seqs an abort asked to end, freeing their host blocks."""
        ended = [s for s in self.seqs.values() if s.seq_id in self.life.finish_requests]
        for seq in ended:
            self._remove(seq)
        if ended:
            self.life.reap(ended, now)
            self.wiring.pool_space()

    def forget_window(self, instance: int) -> None:
        """Decode instance `instance` went offline: its window takes no more requests."""
        self.windows.pop(instance, None)
        self.pending.discard(instance)

    def report_window(self, instance: int, window: Window) -> None:
        # NOTE: reported as the running batch grows, so one decode instance skips the share
        share = (self.policy.matching_share(self.running_lengths(), instance)
                 if len(self.wiring.decodes) > 1 else 1.0)
        if share < 1.0:
            window = window._replace(max_blocks=int(window.max_blocks * share),
                                     max_requests=int(window.max_requests * share))
        self.windows[instance] = window
        self.pending.add(instance)

    def next_order(self, now: float) -> Order | None:
        """A batch for the waiting instance with the most room (`roomiest`), if the pool
        can fill one, else matching requests for the first window that asks; None when
        there is nothing to do. An instance waits while it `wants_batch` and none is being
        staged for it (a second batch would overwrite the first)."""
        staging = {order.instance for order in self.orders if order.batch_id >= 0}
        waiting = self.roomiest([i for i, decode in enumerate(self.wiring.decodes)
                                 if decode.core.wants_batch and i not in staging]
                                ) if self.seqs else None  # rooms only when a batch may go
        if waiting is not None:
            # NOTE: the policy's batch does not depend on the instance (`next_batch` is a
            # query of the pool), so only one waiting instance is asked for
            batch = self.sched.max_batch_size
            self.policy.incoming = self.incoming()
            ids = self.policy.next_batch(self.batch_blocks, batch, now)
            if not ids:  # only requests above the share: give one the whole cache
                ids = self.policy.next_batch(self.num_decode_blocks, batch, now)
            if ids:
                self.num_batches += 1
                return self._take(waiting, self.num_batches, ids)
        for instance in self.match_order():
            self.pending.discard(instance)
            if (order := self._match(instance, now)) is not None:
                return order
        return None

    def incoming(self) -> list[int]:
        """The lengths of the requests on their way to the pool from the prefill instances
        that share a device with a decode instance (`Policy.incoming`); none while one of
        those waits for host-pool room: the pool would not take them before a batch leaves
        it. A prefill the policy holds back brings none of its waiting prompts before a
        decode step."""
        lengths: list[int] = []
        for i in self.shared_prefills:
            core = self.wiring.prefills[i].core
            if core.blocked and (self.kv.free_blocks("host")
                                 < self.kv.blocks_for(core.blocked[0].num_tokens)):
                return []
            waiting = () if core.held() else core.waiting
            lengths += (seq.num_tokens for seq in (*waiting, *core.prefilling, *core.blocked))
        return lengths

    def roomiest(self, instances: list[int]) -> int | None:
        """Of ``instances``, the one with the most room (`DecodeCore.room`: free decode
        blocks, then free slots; ties by index); None if there are none.

        NOTE: instances wait together whenever the pool runs dry (the prefill instances
        set the pace, and in a backlog's tail). In index order decode0 took every batch
        the pool gained while the others idled: its running batch grew past theirs, its
        seqs waited behind its long steps and evictions for their tokens, and it ended
        last. The most room first sends each batch where it gets in soonest."""
        if not instances:
            return None
        rooms = {i: self.wiring.decodes[i].core.room() for i in instances}
        return min(instances, key=lambda i: (-rooms[i][0], -rooms[i][1], i))

    def match_order(self) -> list[int]:
        """The instances whose window wants a matching pass, the one with the most room
        first (free batch slots, then decode blocks; ties by index).

        NOTE: in index order, decode0's window gets the first pick of every request the
        pool gains; with several decode instances it then runs the largest batches and
        ends last, setting the makespan. Most room first keeps the instances even."""
        windows = self.windows
        return sorted(self.pending, key=lambda i: (-windows[i].max_requests,
                                                   -windows[i].max_blocks, i))

    def running_lengths(self) -> list[list[int]]:
        """The KV lengths each decode instance runs (none for one offline)."""
        return [[] if d.core.is_offline else [s.num_tokens for s in d.core.running]
                for d in self.wiring.decodes]

    def _match(self, instance: int, now: float) -> Order | None:
        """Pool requests whose length lies in the instance's running window."""
        window = self.windows.get(instance)
        if window is None or not self.seqs:
            return None
        room = int(self.kv.free_blocks(f"staging{instance}") * MATCH_STAGING_SHARE)
        room = min(room, window.max_blocks)
        if room <= 0 or window.max_requests <= 0:
            return None
        ids = self.policy.matching(window.lo, window.hi, room, window.max_requests, now)
        if not ids:
            return None
        order = self._take(instance, -1, ids)
        taken = sum(self.kv.blocks_for(s.num_computed_tokens) for s in order.seqs)
        # this window's room is spent until the instance reports again
        self.windows[instance] = window._replace(max_blocks=window.max_blocks - taken,
                                                 max_requests=window.max_requests - len(ids))
        return order

    def _take(self, instance: int, batch_id: int, ids: list[str]) -> Order:
        seqs = [self.seqs[seq_id] for seq_id in ids]
        for seq in seqs:
            self._remove(seq)
            seq.instance, seq.batch_id = instance, batch_id
        return Order(instance, batch_id, seqs)

    def _remove(self, seq: SeqState) -> None:
        del self.seqs[seq.seq_id]
        self.policy.remove(seq.seq_id)

    def next_move(self, order: Order, now: float) -> Move | None:
        """The next prefetch (host -> staging) of `order`; None when it is all staged. A
        seq the staging buffer cannot take stays in the host pool and is copied straight to
        the decode device when admitted (also the `aligned-noprefetch` path)."""
        for seq in order.seqs[order.index:]:
            order.index += 1
            if self.policy.uses_staging and seq.seq_id not in self.life.finish_requests:
                move = self.life.reserve(seq, f"staging{order.instance}", at=now)
                if move is not None:
                    return move
        return None

    def landed(self, move: Move, now: float) -> None:
        self.life.transition(move.seq, SeqStatus.STAGED)
        self.life.event(move.seq.seq_id, "prefetched", now)
        self._landing(move).moved.append(move.seq)

    def deliver(self, order: Order, now: float) -> None:
        """Hands the staged order to its decode instance (aborted seqs end here)."""
        live = self.life.reap(order.seqs, now)
        if order.moved:
            self.wiring.pool_space()
        if live:  # with none left (aborted or failed while staged) it still `wants_batch`
            self.wiring.deliver(order.instance, order.batch_id, live)


