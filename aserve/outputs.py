"""Outputs: lifecycle events, iteration records, and each request's output queue.

Actors report here; `Engine.generate` reads the queues; the benchmark reads the events.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from aserve.core import Event, EventKind, IterationRecord, SeqStatus, Sequence, StepOutput


class Outputs:
    """The one place tokens and lifecycle transitions are recorded and streamed."""

    def __init__(self, eos_token_id: int, record_tokens: bool = True,
                 trace_limit: int = 1_000_000) -> None:
        self.eos_token_id = eos_token_id
        self.events: list[Event] = []
        self.iterations: list[IterationRecord] = []  # decode instances (and continuous)
        self.prefill_iterations: list[IterationRecord] = []  # prefill instances' steps
        self.trace_limit = trace_limit  # most events (and iterations) kept; older half dropped
        self.num_dropped_iterations = 0  # absolute index of iterations[0]
        self.queues: dict[str, asyncio.Queue[StepOutput]] = {}
        self.record_tokens = record_tokens  # one "token" event per token (for TPOT)
        self.finish_requests: dict[str, SeqStatus] = {}  # seq_id -> status asked from outside
        self.on_finish: Callable[[Sequence], None] | None = None  # the engine's bookkeeping

    def event(self, seq_id: str, kind: EventKind, at: float | None = None) -> None:
        self.events.append(Event(seq_id, kind, time.perf_counter() if at is None else at))
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
        status = stop_status(seq, self.eos_token_id)
        lp = (logprob,) if seq.sampling.logprobs and logprob is not None else ()
        self._put(seq, StepOutput(seq.seq_id, (token_id,), lp, at))  # type: ignore[arg-type]
        if status is not None:
            self.finish(seq, status, at=at)

    def requested_status(self, seq: Sequence) -> SeqStatus | None:
        """The status an abort or a matched stop string asked for, if any."""
        return self.finish_requests.get(seq.seq_id)

    def finish(self, seq: Sequence, status: SeqStatus, error: str | None = None,
               at: float | None = None) -> None:
        """Marks `seq` finished and ends its stream. The caller frees its KV."""
        assert status.is_finished, f"{status!r} is not a finished state"
        if seq.is_finished:
            return
        at = time.perf_counter() if at is None else at
        seq.status, seq.error = status, error
        for child in seq.forks:  # samples that were to start from its prefill
            self.finish(child, status, error, at)
        seq.forks = []
        self.event(seq.seq_id, "finish", at)
        self.finish_requests.pop(seq.seq_id, None)
        self._put(seq, StepOutput(seq.seq_id, (), (), at, True, seq.finish_reason, error))
        self.queues.pop(seq.seq_id, None)
        if self.on_finish is not None:
            self.on_finish(seq)

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
