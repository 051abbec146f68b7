"""Simulated decode instance (aserve/actors/decode.py): iterations with the policy consulted
at every boundary (evict, refill from candidate requests, switch batches).

Boundary copies (staging -> decode over the device link, host -> decode over the host link,
evictions back) are awaited before the forward, as in the engine; the forward then runs on
the instance's device for the cost model's time.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from functools import partial

from aserve.core import IterationRecord
from bench.sim.cluster import SimContext
from bench.sim.loop import DECODING, POOLED, STAGED, Callback, Link, SimActor, SimSeq
from bench.sim.pool import Batcher, Pool, Window
from bench.sim.prefill import PrefillInstance
from scheduler import BoundaryPlan, BoundaryView, SeqView


class DecodeInstance(SimActor):
    """One decode device: the running batch and its two candidate buffers."""

    def __init__(self, ctx: SimContext, index: int, pool: Pool, batcher: Batcher,
                 prefills: list[PrefillInstance]) -> None:
        super().__init__(ctx.loop)
        cfg = ctx.config
        self.ctx, self.index, self.pool, self.batcher, self.prefills = (
            ctx, index, pool, batcher, prefills)
        self.name = f"decode{index}"
        device = cfg.decode_devices[index]
        staging_device = cfg.prefill_devices[index % len(cfg.prefill_devices)]
        self.device = ctx.device(device)
        self.store = ctx.store(self.name, "decode", cfg.num_decode_blocks)
        self.staging = ctx.store(f"staging{index}", "staging", max(cfg.num_staging_blocks, 1))
        self.from_staging = ctx.peer_link(staging_device, device)
        self.to_staging = ctx.peer_link(device, staging_device)
        self.from_host = ctx.host_link(device, "h2d")
        self.to_host = ctx.host_link(device, "d2h")
        self.staging_to_host = ctx.host_link(staging_device, "d2h")
        self.running: list[SimSeq] = []
        self.cand_requests: list[SimSeq] = []  # evicted or dynamically prefetched
        self.cand_batch: list[SimSeq] = []
        self.cand_batch_id = self.current_batch_id = -1
        self.want_sent = False
        self.window: tuple[int, int] | None = None
        self._copies: deque[tuple[Link, int, Callback | None]] = deque()
        self._missed_wake = False

    @property
    def is_idle(self) -> bool:
        return not (self.running or self.cand_requests or self.cand_batch)

    def receive_batch(self, batch_id: int, seqs: list[SimSeq]) -> None:
        self.cand_batch, self.cand_batch_id = seqs, batch_id
        self.want_sent = False
        self.wake()

    def receive_requests(self, batch_id: int, seqs: list[SimSeq]) -> None:
        self.cand_requests.extend(seqs)
        self.wake()

    def ask_for_batch(self) -> None:
        if not self.cand_batch and not self.want_sent:
            self.want_sent = True
            self.batcher.want(self.index)

    def act(self) -> None:
        if not self.is_idle:
            self._iteration()

    def wake(self) -> None:
        if self.is_busy:
            self._missed_wake = True  # acted on when the boundary's copies have landed
        else:
            super().wake()

    def _iteration(self) -> None:
        start = self.ctx.loop.now
        self._boundary(start)
        self._after_copies(lambda: self._forward(start))

    def _forward(self, start: float) -> None:
        """Runs the iteration once the boundary's copies have landed."""
        ctx = self.ctx
        ready = ctx.loop.now
        self.is_busy = False
        runnable = [s for s in self.running if ctx.stores.grow(s, s.num_tokens)]
        if not runnable:
            self._unstick()
            return
        self._report_window(runnable)
        lengths = [s.num_tokens for s in runnable]
        forward_time = ctx.cost.iteration_time(lengths)
        _, end = self.device.run(ready, forward_time)
        self.is_busy = True
        ctx.loop.at(end, lambda: self._done(start, runnable, lengths, forward_time, ready - start))

    def _copy(self, link: Link, num_blocks: int, on_land: Callback | None = None) -> None:
        """Queues one boundary copy; `_after_copies` issues them one after another."""
        self._copies.append((link, num_blocks, on_land))

    def _after_copies(self, then: Callback) -> None:
        """Issues the queued copies one at a time, each when the previous has landed (the
        engine awaits each move, so on a CPU a prefill queued meanwhile runs between
        them), then calls `then`. The instance is busy meanwhile."""
        if not self._copies:
            then()
            return
        self.is_busy = True
        link, num_blocks, on_land = self._copies.popleft()
        landed = self.ctx.copy(link, self.ctx.loop.now, num_blocks)

        def land() -> None:
            if on_land is not None:
                on_land()
            self._after_copies(then)

        self.ctx.loop.at(landed, land)

    def _done(self, start: float, batch: list[SimSeq], lengths: list[int],
              forward_time: float, schedule_time: float) -> None:
        ctx = self.ctx
        now, rec = ctx.loop.now, ctx.recorder
        finished = []
        for seq in batch:
            seq.num_computed = seq.num_tokens
            if rec.token(seq, now):
                finished.append(seq)
        is_current = {s.batch_id == self.current_batch_id for s in batch}
        rec.iterations.append(IterationRecord(
            instance=self.name, start_time=start, batch_size=len(batch), num_prefill_tokens=0,
            min_len=min(lengths), max_len=max(lengths), forward_time=forward_time,
            schedule_time=schedule_time, is_mixed=len(is_current) > 1,
            blocks_used=ctx.stores.used()))
        self.running = ctx.stores.retire(self.running, finished)
        self.is_busy = False
        self.act()

    def _needs_plan(self) -> bool:
        """Whether the policy has anything to decide at this boundary.

        NOTE: with both candidate buffers empty and the next step's growth fitting the free
        blocks, every built-in policy plans nothing (scheduler.batching.plan_boundary_with);
        skipping the call keeps long decode runs cheap and changes no decision.
        """
        if self.cand_requests or self.cand_batch:
            return True
        block_size = self.ctx.config.block_size
        growth = sum(1 for s in self.running if s.num_tokens > s.num_blocks * block_size)
        return growth > self.store.num_free

    def _boundary(self, start: float) -> None:
        """Applies the policy's plan; its copies are queued (see `_after_copies`)."""
        if self._needs_plan():
            began = time.perf_counter()
            plan: BoundaryPlan = self.ctx.policy.plan_boundary(self._view())
            self.ctx.policy_time += time.perf_counter() - began
            by_id = {s.seq_id: s for s in self.running}
            for seq_id in plan.evict:
                self._evict(by_id[seq_id])
            if plan.to_pool:
                staged = {s.seq_id: s for s in self.cand_requests}
                for seq_id in plan.to_pool:
                    self._to_pool(by_id.get(seq_id) or staged[seq_id])
            if plan.admit_batch:
                self.current_batch_id = self.cand_batch_id
            self._admit(plan.admit_requests, self.cand_requests)
            self._admit(plan.admit_batch, self.cand_batch)
        if not self.cand_batch:
            self.ask_for_batch()

    def _view(self) -> BoundaryView:
        blocks_for = self.ctx.stores.blocks_for

        def views(seqs: Sequence[SimSeq]) -> tuple[SeqView, ...]:
            return tuple(SeqView(s.seq_id, s.num_tokens, blocks_for(s.num_computed),
                                 s.arrival_time, s.batch_id, s.last_token_time) for s in seqs)

        return BoundaryView(
            running=views(self.running), free_blocks=self.store.num_free,
            block_size=self.ctx.config.block_size,
            max_batch_size=self.ctx.config.max_batch_size,
            candidate_requests=views(self.cand_requests),
            candidate_batch=views(self.cand_batch), current_batch_id=self.current_batch_id,
            now=self.ctx.loop.now)

    def _evict(self, seq: SimSeq) -> None:
        """Running -> candidate requests buffer, else host pool, else recompute later."""
        ctx = self.ctx
        self.running.remove(seq)
        ctx.recorder.event(seq, "evicted", ctx.loop.now)
        num_blocks = ctx.stores.move(seq, self.staging)
        if num_blocks:
            seq.status = STAGED
            self.cand_requests.append(seq)
            self._copy(self.to_staging, num_blocks)
            return
        num_blocks = ctx.stores.move(seq, self.pool.host)
        if num_blocks:
            seq.status = POOLED
            self._copy(self.to_host, num_blocks, lambda: self.pool.add(seq))
            return
        ctx.stores.release(seq)  # nowhere to keep the KV: recompute it (vLLM's preemption)
        seq.num_computed = 0
        min(self.prefills, key=lambda p: p.num_waiting_tokens).submit(seq, front=True)

    def _to_pool(self, seq: SimSeq) -> None:
        """A running seq or a candidate request -> host pool, to be batched again (it stays
        where it is if the pool is full)."""
        ctx = self.ctx
        num_blocks = ctx.stores.move(seq, self.pool.host)
        if not num_blocks:
            return
        if seq in self.running:
            self.running.remove(seq)
            ctx.recorder.event(seq, "evicted", ctx.loop.now)
            link = self.to_host
        else:
            self.cand_requests.remove(seq)
            link = self.staging_to_host
        seq.status = POOLED
        self._copy(link, num_blocks, lambda: self.pool.add(seq))

    def _admit(self, seq_ids: tuple[str, ...], buffer: list[SimSeq]) -> None:
        """Candidate buffer -> decode store, copying each seq's KV from where it is."""
        if not seq_ids:
            return
        ctx = self.ctx
        by_id = {seq.seq_id: seq for seq in buffer}
        admitted: set[str] = set()
        freed_host = freed_staging = False
        for seq_id in seq_ids:
            seq = by_id[seq_id]
            source = seq.location
            num_blocks = ctx.stores.move(seq, self.store)
            if not num_blocks:
                continue  # no room after all; it stays in its buffer
            admitted.add(seq_id)
            freed_staging |= source is self.staging
            freed_host |= source is not self.staging
            link = self.from_staging if source is self.staging else self.from_host
            if seq.batch_id < 0:
                seq.batch_id = self.current_batch_id
            starts = seq.status < DECODING
            self._copy(link, num_blocks, partial(self._landed, seq) if starts else None)
            seq.status = DECODING
            self.running.append(seq)
        buffer[:] = [seq for seq in buffer if seq.seq_id not in admitted]
        if freed_host:
            self.pool.notify_space()
        if freed_staging and not self.cand_batch:
            self.want_sent = False
            self.ask_for_batch()

    def _landed(self, seq: SimSeq) -> None:
        self.ctx.recorder.event(seq, "decode_start", self.ctx.loop.now)

    def _unstick(self) -> None:
        """Nothing could run: evict the longest running seq (then retry), or wait."""
        if not self.running:
            if self._missed_wake:
                self._missed_wake = False
                self.wake()
            return
        self._evict(max(self.running, key=lambda s: s.num_tokens))
        self._after_copies(self._resume)

    def _resume(self) -> None:
        self.is_busy = False
        self.act()

    def _report_window(self, runnable: list[SimSeq]) -> None:
        """Tells the batcher the running length window when it changes (dynamic prefetch),
        over the lengths the policy's ``prefetch_basis`` picks, as in the engine."""
        policy = self.ctx.policy
        if not policy.uses_dynamic_prefetch:
            return
        current = [s.num_tokens for s in runnable if s.batch_id == self.current_batch_id]
        lengths = policy.prefetch_basis(current, [s.num_tokens for s in runnable])
        if not lengths:
            return
        window = policy.prefetch_window(lengths)
        if window != self.window:
            self.window = window
            # NOTE: room net of the candidate requests already held, as in the engine
            held = sum(s.num_blocks for s in self.cand_requests)
            slots = self.ctx.config.max_batch_size - len(self.running) - len(self.cand_requests)
            self.batcher.window(self.index, Window(*window, self.store.num_free - held, slots))
