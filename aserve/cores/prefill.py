"""The state machine of a prefill instance."""

from __future__ import annotations

from collections import deque
from typing import Any

from aserve.cores.base import Core, Forward, Move, Pooled
from aserve.engine.sequence import SeqState, SeqStatus
from scheduler.policy import PREFILL_PASSES

# -- prefill --------------------------------------------------------------------------
# PrefillCore: one prefill instance. Packs waiting prompts under a token budget into one
# forward pass; each prefilled request's KV then goes to the host pool, in order, while the
# pool has room (backpressure: no prefill starts while an offload waits for room). In
# arrival order, or shortest first where the policy asks (`Policy.prefills_shortest_first`)
# and the device also decodes; there the policy may also hold the next prefill back while
# enough prefilled requests wait for their first decode step (`Policy.holds_prefill`).


class PrefillCore(Core):
    """A waiting queue, a scratch KV store, and the prefilled seqs waiting for the pool."""

    def __init__(self, ctx: Any, index: int) -> None:
        super().__init__(ctx, f"prefill{index}", index)
        self.waiting: deque[SeqState] = deque()
        self.blocked: deque[SeqState] = deque()  # prefilled; waiting for host-pool room
        self.prefilling: list[SeqState] = []  # the forward in flight
        config = ctx.config
        self.shares_device = config.prefill_devices[index] in config.decode_devices
        # prefills in which later arrivals overtook a waiting seq, by id (shortest first)
        self.overtaken: dict[str, int] = {}

    def submit(self, seq: SeqState, front: bool = False) -> None:
        """A new (or recompute-evicted) request; `front` puts it first in line."""
        self.life.transition(seq, SeqStatus.WAITING)
        (self.waiting.appendleft if front else self.waiting.append)(seq)
        if self.shares_device:
            self.overtaken[seq.seq_id] = PREFILL_PASSES if front else 0

    def reap(self, now: float) -> None:
        """Ends the waiting seqs an abort asked to end (they hold no KV)."""
        num = len(self.waiting)
        self.waiting = deque(self.life.reap(list(self.waiting), now))
        if len(self.waiting) < num:
            self.overtaken = {s.seq_id: self.overtaken[s.seq_id] for s in self.waiting
                              if s.seq_id in self.overtaken}
            self._left()

    def _left(self) -> None:
        """Seqs left the way to the pool without reaching it (ended), or wait for pool room:
        the batcher, whose policy may wait for them (`Policy.incoming`), looks again."""
        if self.wiring.batcher is not None:
            self.wiring.batcher.wake()

    def step(self, now: float) -> Forward | list[Move] | None:
        """Prefilled KV goes to the host pool first, one seq at a time (aborted ones end
        here); no prefill starts while the pool is full (`pool_space` wakes the driver).
        Then the next prefill."""
        while self.blocked:
            seq = self.blocked[0]
            move = self.life.reserve(seq, "host", at=now) if self.life.reap([seq], now) else None
            if move is None and not seq.is_finished:
                self._left()  # held back by a full pool: the batcher must not wait for it
                return None
            self.blocked.popleft()
            if move is not None:
                return [move]
            self._left()
        return self.forward(now) if self.waiting and not self.held() else None

    def held(self) -> bool:
        """Whether the policy holds the next prefill back (`Policy.holds_prefill`), where
        the device also decodes; the wiring wakes this instance when that may change."""
        if not self.shares_device:
            return False
        running = sum(len(d.core.running) for d in self.wiring.decodes)
        return self.policy.holds_prefill(len(self.life.unstarted), running)

    def forward(self, now: float) -> Forward | None:
        """The next packed prefill: waiting seqs up to the token budget whose KV fits."""
        self.reap(now)
        shortest_first = self.shares_device and self.policy.prefills_shortest_first()
        if shortest_first:
            self._shortest_first()
        budget = self.sched.max_prefill_tokens
        batch: list[SeqState] = []
        while self.waiting:
            seq = self.waiting[0]
            if batch and seq.num_tokens > budget:
                break
            if not self.kv.allocate(seq, self.name, seq.num_tokens):
                # NOTE: forward runs on an empty store (step offloads the last batch first),
                # and admission control (BlockLedger.check_fits) sizes every seq to fit it
                assert batch, f"{seq.seq_id} does not fit the empty {self.name} store"
                break
            batch.append(self.waiting.popleft())
            self.overtaken.pop(seq.seq_id, None)
            budget -= seq.num_tokens
        if not batch:
            return None
        if shortest_first:
            self._count_overtakes(batch)
        self.prefilling = batch
        for seq in batch:
            self.life.transition(seq, SeqStatus.PREFILLING)
            self.life.event(seq.seq_id, "prefill_start", now)
        return Forward(self.name, batch, [seq.num_tokens for seq in batch], now)

    def _shortest_first(self) -> None:
        """Puts the waiting seqs in line: those overtaken in ``PREFILL_PASSES`` prefills
        first, in line as they were, then the rest shortest first (ties in line order).
        Forgets the seqs that left the line otherwise (reaped, or moved by a driver)."""
        self.overtaken = {s.seq_id: self.overtaken[s.seq_id] for s in self.waiting}
        due = [s for s in self.waiting if self.overtaken[s.seq_id] >= PREFILL_PASSES]
        rest = sorted((s for s in self.waiting if self.overtaken[s.seq_id] < PREFILL_PASSES),
                      key=lambda s: s.num_tokens)
        self.waiting = deque(due + rest)

    def _count_overtakes(self, batch: list[SeqState]) -> None:
        """``batch`` leaves the line: every waiting seq that arrived before its latest
        arrival was overtaken once more."""
        latest = max(seq.request.arrival_time for seq in batch)
        for seq in self.waiting:
            if seq.request.arrival_time < latest:
                self.overtaken[seq.seq_id] += 1

    def finish(self, step: Forward, token_ids: list[int | None],
               logprobs: list[float | None], now: float, forward_time: float,
               schedule_time: float, fused: bool = False) -> list[Move]:
        """The prefill ran: first tokens (TTFT); live seqs wait to be offloaded. Returns the
        KV copies of the samples forked from these prompts (n > 1), which the driver carries
        out before anything else."""
        self.prefilling = []
        self.life.record(step, forward_time, schedule_time, sum(step.num_new_tokens),
                         packed=True, fused=fused)
        forks = self._advance(step, token_ids, logprobs, now)
        live = [seq for seq in step.seqs if not seq.is_finished]
        self.blocked.extend(live)
        if len(live) < len(step.seqs):
            self._left()
        return forks

    def fail(self, error: str, now: float) -> None:
        """The forward pass (or an offload) failed: the prefilled seqs end with an error."""
        self.life.fail_all((*self.prefilling, *self.blocked), error, now)
        self.prefilling = []
        self.blocked.clear()

    def landed(self, move: Move, now: float) -> None:
        """An offload landed in the pool, or a sample's copy of its prompt's KV (then it
        waits to be offloaded too)."""
        seq = move.seq
        if move.src_ids is not None:
            self.blocked.append(seq)
            return
        self.life.event(seq.seq_id, "pooled", now)
        self.wiring.to_batcher(Pooled(seq))


