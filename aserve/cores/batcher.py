"""BatcherCore: the host pool (its sequences, indexed by the policy) and the batch
generator. Whenever a decode instance's candidate batch buffer is empty it takes the
policy's next batch from the pool; it also takes pool requests matching a running batch's
length window (dynamic prefetch). Each order is staged seq by seq into the instance's
staging buffer on the prefill device, then delivered. The choices are the policy's."""

from __future__ import annotations

from dataclasses import dataclass, field

from aserve.core import SeqStatus, Sequence
from aserve.cores.base import Move, Window, Wiring, seq_view
from aserve.cores.kv import BlockLedger
from aserve.cores.lifecycle import Lifecycle
from scheduler import Policy

MATCH_STAGING_SHARE = 0.5  # at most this share of free staging goes to matching requests


@dataclass(slots=True)
class Order:
    """Seqs taken from the pool for one decode instance: its next candidate batch, or
    candidate requests (batch_id < 0); staged one by one (`index`), then delivered."""

    instance: int
    batch_id: int
    seqs: list[Sequence]
    index: int = 0
    moved: list[Sequence] = field(default_factory=list)


class BatcherCore:
    """Pooled seqs, the decode instances waiting for a batch, and their running windows."""

    def __init__(self, policy: Policy, kv: BlockLedger, life: Lifecycle, wiring: Wiring,
                 num_decode_blocks: int, batch_kv_fraction: float,
                 max_batch_size: int) -> None:
        self.policy, self.kv, self.life, self.wiring = policy, kv, life, wiring
        self.num_decode_blocks = num_decode_blocks
        # NOTE: a batch's budget is a share of the decode cache, not capped by free staging:
        # what the staging buffer cannot take stays in the host pool and is copied straight
        # to decode when admitted, so no request is too big to batch.
        self.batch_blocks = int(num_decode_blocks * batch_kv_fraction)
        self.max_batch_size = max_batch_size
        self.seqs: dict[str, Sequence] = {}
        self.wanting: set[int] = set()
        self.in_flight: set[int] = set()  # instances whose next batch is being staged
        self.windows: dict[int, Window] = {}
        self.pending: set[int] = set()  # instances whose window wants a matching pass
        self.num_batches = 0

    def __len__(self) -> int:
        return len(self.seqs)

    def add(self, seq: Sequence) -> None:
        """`seq`'s KV landed in the host pool: index it."""
        assert seq.location == "host", f"{seq.seq_id} pooled without host KV ({seq.location})"
        self.seqs[seq.seq_id] = seq
        self.policy.add(seq_view(seq, self.kv.blocks_for(seq.num_computed_tokens)))
        self.pool_changed()

    def pool_changed(self) -> None:
        """The pool gained requests or staging room was freed: windows may match again."""
        if self.policy.uses_dynamic_prefetch:
            self.pending.update(self.windows)

    def reap(self, now: float) -> None:
        """Ends the pooled seqs an abort asked to end, freeing their host blocks."""
        ended = [s for s in self.seqs.values() if s.seq_id in self.life.finish_requests]
        for seq in ended:
            self._remove(seq)
        if ended:
            self.life.reap(ended, now)
            self.wiring.pool_space()

    def want(self, instance: int) -> None:
        """An instance's candidate batch buffer is empty. NOTE: while its batch is being
        staged this changes nothing; a second batch would overwrite the first."""
        if instance not in self.in_flight:
            self.wanting.add(instance)

    def report_window(self, instance: int, window: Window) -> None:
        self.windows[instance] = window
        self.pending.add(instance)

    def next_order(self, now: float) -> Order | None:
        """A batch for the first waiting instance the pool can serve, else matching
        requests for the first window that asks; None when there is nothing to do."""
        for instance in sorted(self.wanting):
            if not self.seqs:
                break
            ids = self.policy.next_batch(self.batch_blocks, self.max_batch_size, now)
            if not ids:  # only requests above the share: give one the whole cache
                ids = self.policy.next_batch(self.num_decode_blocks, self.max_batch_size, now)
            if ids:
                self.wanting.discard(instance)
                self.in_flight.add(instance)
                self.num_batches += 1
                return self._take(instance, self.num_batches, ids)
        while self.pending:
            instance = min(self.pending)
            self.pending.discard(instance)
            order = self._match(instance, now)
            if order is not None:
                return order
        return None

    def _match(self, instance: int, now: float) -> Order | None:
        """Pool requests whose length lies in the instance's running window."""
        window = self.windows.get(instance)
        if window is None or not self.policy.uses_dynamic_prefetch or not self.seqs:
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

    def _remove(self, seq: Sequence) -> None:
        del self.seqs[seq.seq_id]
        self.policy.remove(seq.seq_id)

    def next_move(self, order: Order, now: float) -> Move | None:
        """The next prefetch (host -> staging) of `order`; None when it is all staged. A
        seq the staging buffer cannot take stays in the host pool and is copied straight to
        the decode device when admitted (also the `aligned-noprefetch` path)."""
        while order.index < len(order.seqs):
            seq = order.seqs[order.index]
            order.index += 1
            if self.policy.uses_staging and seq.seq_id not in self.life.finish_requests:
                move = self.life.reserve(seq, f"staging{order.instance}", at=now)
                if move is not None:
                    return move
        return None

    def landed(self, order: Order, move: Move, now: float) -> None:
        move.seq.status = SeqStatus.STAGED
        self.life.event(move.seq.seq_id, "prefetched", now)
        order.moved.append(move.seq)

    def deliver(self, order: Order, now: float) -> None:
        """Hands the staged order to its decode instance (aborted seqs end here)."""
        live = self.life.reap(order.seqs, now)
        if order.moved:
            self.wiring.pool_space()
        if order.batch_id >= 0:
            self.in_flight.discard(order.instance)
            if not live:  # none left (aborted or failed while staged): it still wants one
                self.wanting.add(order.instance)
                return
        if live:
            self.wiring.deliver(order.instance, order.batch_id, live)
