"""Lifecycle: the one place a sequence's tokens, status and lifecycle events are written,
and the one finish path (status, event, stream, KV freed exactly once).

Cores and drivers report here; the engine streams outputs through `queues`, the benchmark
and the simulator read `events` and `iterations`. Time is always passed in.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from aserve.core import (
    Event,
    EventKind,
    IterationRecord,
    SeqStatus,
    Sequence,
    StepOutput,
)
from aserve.cores.base import Move
from aserve.cores.kv import BlockLedger

logger = logging.getLogger(__name__)


class Lifecycle:
    """Events, iteration records, each request's output stream, and finishing."""

    def __init__(self, kv: BlockLedger | None, eos_token_id: int, record_tokens: bool = True,
                 trace_limit: int = 1_000_000) -> None:
        self.kv = kv  # frees a finished seq's blocks (None: the caller frees them)
        self.eos_token_id = eos_token_id
        self.events: list[Event] = []
        self.iterations: list[IterationRecord] = []  # decode instances (and continuous)
        self.prefill_iterations: list[IterationRecord] = []  # prefill instances' steps
        self.trace_limit = trace_limit  # most events (and iterations) kept; older half dropped
        self.num_dropped_iterations = 0  # absolute index of iterations[0]
        self.queues: dict[str, Any] = {}  # seq_id -> a queue with put_nowait (the engine's)
        self.record_tokens = record_tokens  # one "token" event per token (for TPOT)
        self.finish_requests: dict[str, SeqStatus] = {}  # seq_id -> status asked from outside
        self.on_finish: Callable[[Sequence], None] | None = None  # the driver's bookkeeping
        self.num_finished = 0

    def event(self, seq_id: str, kind: EventKind, at: float) -> None:
        self.events.append(Event(seq_id, kind, at))
        if len(self.events) > self.trace_limit:  # a long-running server must not grow forever
            del self.events[: self.trace_limit // 2]

    def iteration(self, record: IterationRecord) -> None:
        self.iterations.append(record)
        if len(self.iterations) > self.trace_limit:
            half = self.trace_limit // 2
            del self.iterations[:half]
            self.num_dropped_iterations += half

    def prefill_iteration(self, record: IterationRecord) -> None:
        self.prefill_iterations.append(record)
        if len(self.prefill_iterations) > self.trace_limit:
            del self.prefill_iterations[: self.trace_limit // 2]

    def append_token(self, seq: Sequence, token_id: int, logprob: float | None,
                     at: float) -> None:
        """Appends one sampled token, records its event, streams it, and finishes the
        sequence if a stop condition holds."""
        first = seq.num_output_tokens == 0
        seq.append_token(token_id, at, logprob if seq.sampling.logprobs else None)
        if first:
            self.event(seq.seq_id, "first_token", at)
        elif self.record_tokens:
            self.event(seq.seq_id, "token", at)
        lp = (logprob,) if seq.sampling.logprobs and logprob is not None else ()
        self._put(seq, StepOutput(seq.seq_id, (token_id,), lp, at))  # type: ignore[arg-type]
        status = stop_status(seq, self.eos_token_id)
        if status is not None:
            self.finish(seq, status, at=at)

    def abort(self, seq_id: str, status: SeqStatus = SeqStatus.FINISHED_ABORTED) -> None:
        """Asks for `seq_id` to end; the core that holds it finishes it at its next safe
        point (never mid-forward or mid-copy)."""
        self.finish_requests.setdefault(seq_id, status)

    def reap(self, seqs: list[Sequence], at: float) -> list[Sequence]:
        """Finishes the seqs an abort or stop string asked to end; returns the live ones."""
        live = []
        for seq in seqs:
            status = self.finish_requests.get(seq.seq_id)
            if status is not None:
                self.finish(seq, status, at=at)
            elif not seq.is_finished:
                live.append(seq)
        return live

    def finish(self, seq: Sequence, status: SeqStatus, error: str | None = None, *,
               at: float, release: bool = True) -> None:
        """Marks `seq` finished, ends its stream and frees its blocks (unless `release` is
        False: another task may still be using them)."""
        assert status.is_finished, f"{status!r} is not a finished state"
        if release and self.kv is not None:
            self.kv.release(seq)
        if seq.is_finished:
            return
        seq.status, seq.error = status, error
        self.num_finished += 1
        for child in seq.forks:  # samples that were to start from its prefill
            self.finish(child, status, error, at=at)
        seq.forks = []
        self.event(seq.seq_id, "finish", at)
        self.finish_requests.pop(seq.seq_id, None)
        self._put(seq, StepOutput(seq.seq_id, (), (), at, True, seq.finish_reason, error))
        self.queues.pop(seq.seq_id, None)
        if self.on_finish is not None:
            self.on_finish(seq)

    def reserve(self, seq: Sequence, dst: str, *, at: float) -> Move | None:
        """`BlockLedger.reserve`, except that a store refusing the allocation by raising
        ends `seq` alone with an error (check `seq.is_finished` after None)."""
        assert self.kv is not None, "reserve needs the block ledger"
        try:
            return self.kv.reserve(seq, dst)
        except Exception as exc:  # a store's failure is this seq's, not the instance's
            logger.exception("reserving %s for %s failed", dst, seq.seq_id)
            self.finish(seq, SeqStatus.FINISHED_ERROR, f"{type(exc).__name__}: {exc}", at=at)
            return None

    def fork(self, seq: Sequence, at: float) -> tuple[list[Move], list[Sequence]]:
        """Starts the samples waiting on `seq`'s prefill (n > 1), right after it: each gets
        blocks in `seq`'s store for a copy of the prompt's KV but the last token, which it
        recomputes to draw its own first token, and a copy of the prompt logprobs. Call
        when the prefill step's outputs are recorded, before any of the step's first tokens
        is appended (that may free `seq`'s blocks); the driver copies the returned moves
        before its instance allocates again, then hands each landed fork to its core.

        Returns (the forks' KV moves, each fork in `seq`'s status; the samples the store had
        no room for, to be prefilled on their own). A store raising ends that sample alone.
        """
        assert self.kv is not None, "fork needs the block ledger"
        moves: list[Move] = []
        unforked: list[Sequence] = []
        num_cached = seq.num_prompt_tokens - 1
        for child in self.reap(seq.forks, at):
            try:
                move = self.kv.fork(seq, child, num_cached)
            except Exception as exc:  # a store's failure is this sample's, not the instance's
                logger.exception("forking %s from %s failed", child.seq_id, seq.seq_id)
                self.finish(child, SeqStatus.FINISHED_ERROR, f"{type(exc).__name__}: {exc}",
                            at=at)
                continue
            if move is None:
                unforked.append(child)
                continue
            child.num_computed_tokens, child.status = num_cached, seq.status
            child.prompt_logprobs[:] = seq.prompt_logprobs
            moves.append(move)
        seq.forks = []
        return moves, unforked

    def fail_move(self, move: Move, error: str, *, at: float) -> None:
        """A KV copy failed: its destination is freed and the seq alone ends with an error."""
        if self.kv is not None:
            self.kv.cancel(move)
        self.finish(move.seq, SeqStatus.FINISHED_ERROR, error, at=at)

    def _put(self, seq: Sequence, out: StepOutput) -> None:
        queue = self.queues.get(seq.seq_id)
        if queue is not None:
            queue.put_nowait(out)


def stop_status(seq: Sequence, eos_token_id: int) -> SeqStatus | None:
    """The finished state `seq` has reached after its newest token, if any."""
    params = seq.sampling
    last = seq.token_ids[-1]
    if seq.num_output_tokens >= params.min_tokens:
        if last in params.stop_token_ids or (last == eos_token_id and not params.ignore_eos):
            return SeqStatus.FINISHED_STOPPED
    if seq.num_output_tokens >= params.max_tokens:
        return SeqStatus.FINISHED_LENGTH
    return None
