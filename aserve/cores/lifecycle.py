"""The one place a sequence's tokens, status and lifecycle events are written."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from aserve.cores.base import Forward, Move
from aserve.cores.ledger import keep_bounded
from aserve.engine.sequence import (
    Event,
    EventKind,
    IterationRecord,
    SeqState,
    SeqStatus,
    StepOutput,
)

if TYPE_CHECKING:
    from aserve.cores.ledger import BlockLedger

logger = logging.getLogger(__name__)


# -- lifecycle ------------------------------------------------------------------------
# Lifecycle: the one place a sequence's tokens, status and lifecycle events are written,
# and the one finish path (status, event, stream, KV freed exactly once).
#
# Cores and drivers report here; the engine streams outputs through `queues`, the benchmark
# and the simulator read `events` and `iterations`. Time is always passed in.


class Lifecycle:
    """Events, iteration records, each request's output stream, and finishing."""

    def __init__(self, kv: BlockLedger, eos_token_id: int, record_tokens: bool = True,
                 trace_limit: int | None = None) -> None:
        self.kv = kv  # frees a finished seq's blocks
        self.eos_token_id = eos_token_id
        self.events: list[Event] = []
        self.iterations: list[IterationRecord] = []  # decode instances (and continuous)
        self.prefill_iterations: list[IterationRecord] = []  # prefill instances' steps
        self.trace_limit = trace_limit  # most events (and iterations) kept; None: all
        self.num_dropped_iterations = 0  # absolute index of iterations[0]
        self.queues: dict[str, Any] = {}  # seq_id -> a queue with put_nowait (the engine's)
        self.record_tokens = record_tokens  # one "token" event per token (for TPOT)
        self.finish_requests: dict[str, SeqStatus] = {}  # seq_id -> status asked from outside
        self.on_finish: Callable[[SeqState], None] = lambda seq: None  # the driver's bookkeeping
        self.num_finished = 0
        self.retried: set[str] = set()  # seqs whose forward failed once (`retry_once`)
        # live seqs with their first token and not their second (`Policy.prefill_quota`),
        # and what a seq leaving that set calls (the wiring's: held prefills look again)
        self.unstarted: set[str] = set()
        self.on_started: Callable[[], None] = lambda: None

    def _keep(self, trace: list[Any], item: object) -> int:
        return keep_bounded(trace, item, self.trace_limit)

    def event(self, seq_id: str, kind: EventKind, at: float) -> None:
        self._keep(self.events, Event(seq_id, kind, at))

    def iteration(self, record: IterationRecord) -> None:
        self.num_dropped_iterations += self._keep(self.iterations, record)

    def record(self, step: Forward, forward_time: float, schedule_time: float,
               num_prefill_tokens: int = 0, is_mixed: bool = False,
               packed: bool = False, fused: bool = False) -> None:
        """Records one forward pass; a prefill instance's (`packed` prompts) apart."""
        record = IterationRecord(
            step.instance, step.start_time, len(step.seqs), num_prefill_tokens,
            min(step.lengths), max(step.lengths), forward_time, schedule_time, is_mixed,
            self.kv.blocks_used(), step.lengths, tuple(step.num_new_tokens), fused)
        if packed:
            self._keep(self.prefill_iterations, record)
        else:
            self.iteration(record)

    def append_token(self, seq: SeqState, token_id: int, logprob: float | None,
                     at: float) -> None:
        """Appends one sampled token, records its event, streams it, and finishes the
        sequence if a stop condition holds (a stop token or EOS once `min_tokens` are out,
        else `max_tokens`)."""
        first = seq.num_output_tokens == 0
        seq.append_token(token_id, at, logprob if seq.sampling.logprobs else None)
        if first:
            self.event(seq.seq_id, "first_token", at)
            self.unstarted.add(seq.seq_id)
        else:
            self._started(seq)
            if self.record_tokens:
                self.event(seq.seq_id, "token", at)
        lp = (logprob,) if seq.sampling.logprobs and logprob is not None else ()
        if (queue := self.queues.get(seq.seq_id)) is not None:
            queue.put_nowait(StepOutput(seq.seq_id, (token_id,), lp, at))  # type: ignore[arg-type]
        params = seq.sampling
        if seq.num_output_tokens >= params.min_tokens and (token_id in params.stop_token_ids or (
                token_id == self.eos_token_id and not params.ignore_eos)):
            self.finish(seq, SeqStatus.FINISHED_STOPPED, at=at)
        elif seq.num_output_tokens >= params.max_tokens:
            self.finish(seq, SeqStatus.FINISHED_LENGTH, at=at)

    def _started(self, seq: SeqState) -> None:
        """`seq` got its second token or ended: it no longer counts as unstarted."""
        if seq.seq_id in self.unstarted:
            self.unstarted.remove(seq.seq_id)
            self.on_started()

    def transition(self, seq: SeqState, status: SeqStatus) -> None:
        """Moves `seq` to `status`: the one writer of a request's status (a finished one
        through `finish`, which also ends the stream and frees the KV). A finished seq
        never changes again."""
        assert not seq.is_finished, f"{seq.seq_id}: {seq.status!r} -> {status!r}"
        seq.status = status

    def abort(self, seq_id: str, status: SeqStatus = SeqStatus.FINISHED_ABORTED) -> None:
        """Asks for `seq_id` to end; the core that holds it finishes it at its next safe
        point (never mid-forward or mid-copy)."""
        self.finish_requests.setdefault(seq_id, status)

    def reap(self, seqs: list[SeqState], at: float) -> list[SeqState]:
        """Finishes the seqs an abort or stop string asked to end; returns the live ones."""
        live = []
        for seq in seqs:
            status = self.finish_requests.get(seq.seq_id)
            if status is not None:
                self.finish(seq, status, at=at)
            elif not seq.is_finished:
                live.append(seq)
        return live

    def finish(self, seq: SeqState, status: SeqStatus, error: str | None = None, *,
               at: float, release: bool = True) -> None:
        """Marks `seq` finished, ends its stream and frees its blocks (unless `release` is
        False: another task may still be using them)."""
        assert status.is_finished, f"{status!r} is not a finished state"
        if release:
            self.kv.release(seq)
        self.retried.discard(seq.seq_id)
        if seq.is_finished:
            return
        self._started(seq)
        self.transition(seq, status)
        seq.error = error
        self.num_finished += 1
        for child in seq.forks:  # samples that were to start from its prefill
            self.finish(child, status, error, at=at)
        seq.forks = []
        self.event(seq.seq_id, "finish", at)
        self.finish_requests.pop(seq.seq_id, None)
        if (queue := self.queues.pop(seq.seq_id, None)) is not None:
            queue.put_nowait(StepOutput(seq.seq_id, (), (), at, True, seq.finish_reason, error))
        self.on_finish(seq)

    def reserve(self, seq: SeqState, dst: str, parent: SeqState | None = None, *,
                at: float) -> Move | None:
        """`BlockLedger.reserve`, except that a store refusing the allocation by raising
        ends `seq` alone with an error (check `seq.is_finished` after None)."""
        try:
            return self.kv.reserve(seq, dst, parent)
        except Exception as exc:  # a store's failure is this seq's, not the instance's
            logger.exception("allocating KV for %s failed", seq.seq_id)
            self.fail_all([seq], f"{type(exc).__name__}: {exc}", at)
            return None

    def retry_once(self, seqs: Iterable[SeqState], error: str, at: float) -> list[SeqState]:
        """The seqs of a failed forward pass: a seq's first such failure keeps it (its KV
        up to its computed tokens is intact, and the step computes the rest again); its
        second ends it with `error`. Returns the seqs kept."""
        kept = []
        for seq in seqs:
            if seq.seq_id in self.retried:
                self.finish(seq, SeqStatus.FINISHED_ERROR, error, at=at)
            elif not seq.is_finished:
                self.retried.add(seq.seq_id)
                kept.append(seq)
        return kept

    def fail_all(self, seqs: Iterable[SeqState], error: str, at: float) -> None:
        """Ends each of `seqs` with `error` (a failed forward, copy or store)."""
        for seq in seqs:
            self.finish(seq, SeqStatus.FINISHED_ERROR, error, at=at)


