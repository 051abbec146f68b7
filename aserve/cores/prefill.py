"""The state machine of a prefill instance."""

from __future__ import annotations

from collections import deque
from typing import Any

from aserve.cores.base import Core, Forward, Move, Pooled
from aserve.engine.sequence import SeqState, SeqStatus

# -- prefill --------------------------------------------------------------------------
# PrefillCore: one prefill instance. Packs waiting prompts under a token budget into one
# forward pass; each prefilled request's KV then goes to the host pool, in order, while the
# pool has room (backpressure: no prefill starts while an offload waits for room).


class PrefillCore(Core):
    """A waiting queue, a scratch KV store, and the prefilled seqs waiting for the pool."""

    def __init__(self, ctx: Any, index: int) -> None:
        super().__init__(ctx, f"prefill{index}", index)
        self.waiting: deque[SeqState] = deque()
        self.blocked: deque[SeqState] = deque()  # prefilled; waiting for host-pool room
        self.prefilling: list[SeqState] = []  # the forward in flight

    def submit(self, seq: SeqState, front: bool = False) -> None:
        """A new (or recompute-evicted) request; `front` puts it first in line."""
        self.life.transition(seq, SeqStatus.WAITING)
        (self.waiting.appendleft if front else self.waiting.append)(seq)

    def reap(self, now: float) -> None:
        """Ends the waiting seqs an abort asked to end (they hold no KV)."""
        num = len(self.waiting)
        self.waiting = deque(self.life.reap(list(self.waiting), now))
        if len(self.waiting) < num:
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
        return self.forward(now) if self.waiting else None

    def forward(self, now: float) -> Forward | None:
        """The next packed prefill: waiting seqs up to the token budget whose KV fits."""
        self.reap(now)
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
            budget -= seq.num_tokens
        if not batch:
            return None
        self.prefilling = batch
        for seq in batch:
            self.life.transition(seq, SeqStatus.PREFILLING)
            self.life.event(seq.seq_id, "prefill_start", now)
        return Forward(self.name, batch, [seq.num_tokens for seq in batch], now)

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


