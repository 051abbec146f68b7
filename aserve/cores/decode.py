"""The state machine of a decode instance."""

from __future__ import annotations

from typing import Any

from aserve.cores.base import (
    Core,
    Forward,
    Move,
    Pooled,
    StagingFreed,
    WantsBatch,
    Window,
    WindowReport,
    seq_views,
)
from aserve.engine.sequence import SeqState, SeqStatus
from scheduler import BoundaryPlan, BoundaryView

# -- decode ---------------------------------------------------------------------------
# DecodeCore: one decode instance. At every iteration boundary it applies the policy's
# batch-level scheduling (release, evict, return to the pool, refill from candidate
# requests, switch batches) as KV moves; then it names the seqs of the next iteration.
#
# `step` runs: `boundary` -> its moves -> the admissions' moves, once the evictions have
# freed their room -> `forward` -> `finish`; an eviction for room instead, then a new
# boundary.


class DecodeCore(Core):
    """The running batch and its two candidate buffers."""

    def __init__(self, ctx: Any, index: int) -> None:
        super().__init__(ctx, f"decode{index}", index)
        self.staging = f"staging{index}"
        self.running: list[SeqState] = []
        self.cand_requests: list[SeqState] = []  # evicted or dynamically prefetched
        self.cand_batch: list[SeqState] = []
        self.cand_batch_id = self.current_batch_id = -1
        self.wants_batch = True  # a batch was asked for (the first: `Wiring.connect`)
        self.window: tuple[int, int] | None = None
        self._freed: set[str] = set()  # stores whose blocks this boundary's moves freed
        self._admissions: BoundaryPlan | None = None  # planned, not yet reserved
        self._forward_next = False  # the boundary is planned: the iteration comes next

    def receive(self, batch_id: int, seqs: list[SeqState]) -> None:
        """Staged seqs from the batcher: the next candidate batch, or candidate requests
        when `batch_id` < 0."""
        if batch_id < 0:
            self.cand_requests.extend(seqs)
            return
        assert not self.cand_batch, f"{self.name} got a batch while holding one"
        self.cand_batch, self.cand_batch_id = seqs, batch_id
        self.wants_batch = False

    def reap(self, now: float) -> None:
        """Ends the candidate seqs an abort asked to end (the running ones end at the next
        boundary: a forward may be using their KV)."""
        self.cand_requests = self.life.reap(self.cand_requests, now)
        self.cand_batch = self.life.reap(self.cand_batch, now)
        self.ask_for_batch()

    def ask_for_batch(self) -> None:
        if not self.cand_batch and not self.wants_batch and not self.is_offline:
            self.wants_batch = True
            self.wiring.to_batcher(WantsBatch())

    def step(self, now: float) -> Forward | list[Move] | None:
        """The boundary's moves; once they landed, the admissions' moves; once those landed,
        the freed room is announced and the iteration follows. None while idle or waiting
        for a batch."""
        if (plan := self._admissions) is not None:
            self._admissions = None
            if not {s.seq_id for s in self.cand_batch}.isdisjoint(plan.admit_batch):
                self.current_batch_id = self.cand_batch_id
            moves = self._admit(plan.admit_requests, self.cand_requests, now)
            moves += self._admit(plan.admit_batch, self.cand_batch, now)
            self.wiring.holds_may_change()
            self.ask_for_batch()
            if moves:
                return moves
        if "host" in self._freed:
            self.wiring.pool_space()
        if self.staging in self._freed:
            self.wiring.to_batcher(StagingFreed())
        self._freed.clear()
        if self._forward_next:
            self._forward_next = False
            return self.forward(now) or None  # an eviction's moves: then a new boundary
        if not (self.running or self.cand_requests or self.cand_batch):
            self.wiring.holds_may_change()  # the last seqs ended: a hold may lift
            return None  # idle
        moves = self.boundary(now)
        self._forward_next = True
        return moves or self.step(now)

    # -- the boundary ------------------------------------------------------------------
    def boundary(self, now: float) -> list[Move]:
        """Releases ended seqs and applies the policy's plan; returns the KV moves out of the
        running batch (evictions, returns to the pool), in order. The admissions follow
        from `step`, once these moves have freed their decode blocks."""
        self.running = self.life.reap(self.running, now)
        self.reap(now)
        plan = self.policy.plan_boundary(self.view(now)) if self._needs_plan() else BoundaryPlan()
        by_id = {s.seq_id: s for s in (*self.running, *self.cand_requests)}
        moves = [m for i in plan.evict for m in self._evict(by_id[i], now)]
        moves += [m for i in plan.to_pool for m in self._to_pool(by_id[i], now)]
        self._admissions = plan
        self.wiring.holds_may_change()  # ended, evicted and returned seqs left it
        return moves

    def _needs_plan(self) -> bool:
        """Whether the policy has anything to decide at this boundary.

        NOTE: with both candidate buffers empty and the next step's growth fitting the free
        blocks, every built-in policy plans nothing (scheduler.batching.plan_boundary_with);
        skipping the call keeps long decode runs cheap and changes no decision.
        """
        if self.cand_requests or self.cand_batch:
            return True
        growth = sum(self.kv.blocks_for(s.num_tokens) - self.kv.blocks_for(s.num_computed_tokens)
                     for s in self.running)  # blocks the next step adds
        return growth > self.kv.free_blocks(self.name)

    def view(self, now: float) -> BoundaryView:
        return BoundaryView(
            running=seq_views(self.running, self.kv), free_blocks=self.kv.free_blocks(self.name),
            block_size=self.kv.block_size, max_batch_size=self.sched.max_batch_size,
            candidate_requests=seq_views(self.cand_requests, self.kv),
            candidate_batch=seq_views(self.cand_batch, self.kv),
            current_batch_id=self.current_batch_id, now=now)

    def _evict(self, seq: SeqState, now: float) -> list[Move]:
        """Running -> candidate requests buffer, else host pool, else recompute later."""
        self.running.remove(seq)
        self.life.event(seq.seq_id, "evicted", now)
        move = self.life.reserve(seq, self.staging, at=now)
        if move is None and not seq.is_finished:
            move = self.life.reserve(seq, "host", at=now)
        if move is None and not seq.is_finished:
            self.kv.release(seq)  # nowhere to keep the KV: recompute it (vLLM's preemption)
            seq.num_computed_tokens = 0
            self.wiring.submit(seq, front=True)  # prefill it again, first in line
        return [move] if move else []

    def release_candidates(self, now: float) -> list[Move]:
        """The instance went offline (its driver lost the device): the staged candidates
        go back to the host pool, to be batched for another instance; those the pool has
        no room for yet stay staged."""
        self.cand_requests.extend(self.cand_batch)
        self.cand_batch = []
        return [move for seq in list(self.cand_requests) for move in self._to_pool(seq, now)]

    def _to_pool(self, seq: SeqState, now: float) -> list[Move]:
        """A running seq or a candidate request -> host pool, to be batched again. If the
        pool has no room, a candidate request stays where it is and a running seq leaves
        as an evicted one would."""
        never_staged = seq.location == "host"  # a candidate request: no copy
        move = None if never_staged else self.life.reserve(seq, "host", at=now)
        if move is None and not never_staged and not seq.is_finished:
            # NOTE: the boundary plan's admissions count on the room a running seq leaves:
            # kept running, they would take the room the running seqs grow into, the step
            # would evict one, and the next boundary could plan the same, with no token
            # between (a livelock).
            return self._evict(seq, now) if seq in self.running else []
        seq.num_returns += 1
        if seq in self.running:
            self.running.remove(seq)
            self.life.event(seq.seq_id, "evicted", now)
        else:
            self.cand_requests.remove(seq)
        if never_staged:
            self.wiring.to_batcher(Pooled(seq))
        return [move] if move else []

    def _admit(self, seq_ids: tuple[str, ...], buffer: list[SeqState],
               now: float) -> list[Move]:
        """Candidate buffer -> decode cache (from staging over the device link, or from
        the host pool for seqs that were never staged)."""
        by_id = {seq.seq_id: seq for seq in buffer}
        moves = []
        for seq_id in seq_ids:
            seq = by_id.get(seq_id)
            if seq is None:
                continue  # ended by an abort while the boundary's moves were in flight
            move = self.life.reserve(seq, self.name, at=now)
            if move is None and not seq.is_finished:
                continue  # no room after all; it stays in its buffer
            buffer.remove(seq)
            if move is None:
                continue
            if seq.batch_id < 0:
                seq.batch_id = self.current_batch_id
            self.running.append(seq)
            moves.append(move)
        return moves

    def landed(self, move: Move, now: float) -> None:
        seq = move.seq
        self._freed.add(move.src)
        if move.dst == self.name:
            if seq.status < SeqStatus.DECODING:
                self.life.event(seq.seq_id, "decode_start", now)
            self.life.transition(seq, SeqStatus.DECODING)
        elif move.dst == self.staging:
            self.life.transition(seq, SeqStatus.STAGED)
            self.cand_requests.append(seq)
        else:
            self.wiring.to_batcher(Pooled(seq))

    def failed(self, move: Move, error: str, now: float) -> None:
        """A boundary copy failed: that seq alone ends with an error."""
        if move.seq in self.running:
            self.running.remove(move.seq)
        super().failed(move, error, now)

    # -- the iteration -------------------------------------------------------------------
    def forward(self, now: float) -> Forward | list[Move]:
        """The next iteration: every running seq whose KV can grow. If none can, evicts the
        longest running seq (moves to carry out, then a new boundary; a seq whose KV was
        dropped frees its room at once) or, with none running, returns [] (wait for the
        batcher)."""
        dropped = False
        while not (runnable := self._growable()) and self.running:
            longest = max(self.running, key=lambda s: s.num_tokens)
            moves = self._evict(longest, now)
            if moves:
                return moves
            # NOTE: with the staging buffer and the host pool full, the evicted seq's KV
            # was dropped, to be prefilled again, and no copy will land to bring the next
            # boundary. So the iteration goes on here, on the room it freed; with no seq
            # left, the next boundary admits the candidates now. Returning none would
            # leave the instance idle with its candidates staged, while the full host pool
            # waits on them.
            dropped = True
        if not runnable:
            return (self.step(now) or []) if dropped else []
        self._report_window(runnable)
        return Forward(self.name, runnable,
                       [s.num_tokens - s.num_computed_tokens for s in runnable], now)

    def _growable(self) -> list[SeqState]:
        """The running seqs whose KV can grow by the next step's token (grown now)."""
        return [s for s in self.running if self.kv.grow(s, s.num_tokens)]

    def _report_window(self, runnable: list[SeqState]) -> None:
        """Tells the batcher the length window of pool requests that could join the running
        batch (the policy's ``prefetch_basis`` and ``prefetch_window``) when it changes."""
        if not self.policy.uses_dynamic_prefetch:
            return
        current = [s.num_tokens for s in runnable if s.batch_id == self.current_batch_id]
        lengths = self.policy.prefetch_basis(current, [s.num_tokens for s in runnable])
        if not lengths:
            return
        window = self.policy.prefetch_window(lengths)
        if window != self.window:
            self.window = window
            self.wiring.to_batcher(WindowReport(self.index, Window(*window, *self.room())))

    def room(self) -> tuple[int, int]:
        """The decode blocks and batch slots free for what the batcher sends next.

        NOTE: net of what the candidate requests buffer already holds: matching requests
        beyond what the batch can take would drain the pool into staging, and the next
        batch would then be chosen from what little is left there."""
        held = sum(self.kv.blocks_for(s.num_computed_tokens) for s in self.cand_requests)
        slots = self.sched.max_batch_size - len(self.running) - len(self.cand_requests)
        return self.kv.free_blocks(self.name) - held, slots

    def fail(self, error: str, now: float) -> None:
        """The forward pass failed: the running batch ends with an error; the candidate
        buffers survive."""
        super().fail(error, now)
        self._forward_next, self._admissions = False, None


