"""PrefillCore: one prefill instance. Packs waiting prompts under a token budget into one
forward pass; each prefilled request's KV then goes to the host pool, in order, while the
pool has room (backpressure: no prefill starts while an offload waits for room)."""

from __future__ import annotations

from collections import deque

from aserve.core import IterationRecord, SeqStatus, Sequence
from aserve.cores.base import Forward, Move, Wiring
from aserve.cores.kv import BlockLedger
from aserve.cores.lifecycle import Lifecycle


class PrefillCore:
    """A waiting queue, a scratch KV store, and the prefilled seqs waiting for the pool."""

    def __init__(self, index: int, kv: BlockLedger, life: Lifecycle, wiring: Wiring,
                 max_prefill_tokens: int) -> None:
        self.index, self.name = index, f"prefill{index}"
        self.kv, self.life, self.wiring = kv, life, wiring
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.blocked: deque[Sequence] = deque()  # prefilled; waiting for host-pool room

    @property
    def num_waiting_tokens(self) -> int:
        return sum(seq.num_tokens for seq in self.waiting)

    @property
    def can_prefill(self) -> bool:
        return bool(self.waiting) and not self.blocked

    def submit(self, seq: Sequence, front: bool = False) -> None:
        """A new (or recompute-evicted) request; `front` puts it first in line."""
        seq.status = SeqStatus.WAITING
        (self.waiting.appendleft if front else self.waiting.append)(seq)

    def reap(self, now: float) -> None:
        """Ends the waiting seqs an abort asked to end (they hold no KV)."""
        self.waiting = deque(self.life.reap(list(self.waiting), now))

    def forward(self, now: float) -> Forward | None:
        """The next packed prefill: waiting seqs up to the token budget whose KV fits."""
        self.reap(now)
        budget = self.max_prefill_tokens
        batch: list[Sequence] = []
        while self.waiting:
            seq = self.waiting[0]
            if batch and seq.num_tokens > budget:
                break
            if not self.kv.allocate(seq, self.name, seq.num_tokens):
                break
            batch.append(self.waiting.popleft())
            budget -= seq.num_tokens
        if not batch:
            if self.waiting:  # admission control makes this a bug
                self.life.finish(self.waiting.popleft(), SeqStatus.FINISHED_ERROR,
                                 "prompt does not fit the prefill KV store", at=now)
            return None
        for seq in batch:
            seq.status = SeqStatus.PREFILLING
            self.life.event(seq.seq_id, "prefill_start", now)
        return Forward(self.name, batch, [seq.num_tokens for seq in batch], now)

    def finish(self, step: Forward, token_ids: list[int | None],
               logprobs: list[float | None], now: float, forward_time: float) -> list[Move]:
        """The prefill ran: first tokens (TTFT); live seqs wait to be offloaded. Returns the
        KV copies of the samples forked from these prompts (n > 1), which the driver carries
        out before anything else, calling `forked` as each lands."""
        lengths = tuple(step.num_new_tokens)
        self.life.prefill_iteration(IterationRecord(
            instance=self.name, start_time=step.start_time, batch_size=len(step.seqs),
            num_prefill_tokens=sum(lengths), min_len=min(lengths), max_len=max(lengths),
            forward_time=forward_time, schedule_time=0.0, is_mixed=False,
            blocks_used=self.kv.blocks_used(), prefill_lengths=lengths))
        forks: list[Move] = []
        for seq, token_id, logprob in zip(step.seqs, token_ids, logprobs):
            assert token_id is not None, "prefill of a whole sequence always samples"
            seq.num_computed_tokens = seq.num_tokens
            self.life.event(seq.seq_id, "prefill_end", now)
            # NOTE: forks are reserved before the first token may finish `seq` and free its
            # blocks; the driver copies them in this order, so a later fork's destination
            # never overwrites an earlier fork's source before it is read
            moves, unforked = self.life.fork(seq, now)
            forks.extend(moves)
            for child in reversed(unforked):
                self.submit(child, front=True)
            self.life.append_token(seq, token_id, logprob, now)
            if not seq.is_finished:
                self.blocked.append(seq)
        return forks

    def forked(self, move: Move, now: float) -> None:
        """A sample's copy of its prompt's KV landed: it waits to be offloaded too."""
        self.blocked.append(move.seq)

    def fail(self, step: Forward, error: str, now: float) -> None:
        """The forward pass failed: its seqs end with an error."""
        for seq in step.seqs:
            self.life.finish(seq, SeqStatus.FINISHED_ERROR, error, at=now)

    def next_offload(self, now: float) -> Move | None:
        """The next prefilled seq's move to the host pool; None when there is none or the
        pool is full (then `pool_space` wakes the driver)."""
        while self.blocked:
            seq = self.blocked[0]
            if not self.life.reap([seq], now):
                self.blocked.popleft()
                continue
            move = self.life.reserve(seq, "host", at=now)
            if move is None and not seq.is_finished:
                return None
            self.blocked.popleft()
            if move is not None:
                return move
        return None

    def landed(self, move: Move, now: float) -> None:
        seq = move.seq
        seq.status = SeqStatus.POOLED
        self.life.event(seq.seq_id, "pooled", now)
        self.wiring.pooled(seq)
