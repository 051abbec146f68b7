"""What the cores hand their drivers (KV moves and forward passes as data), the base of
every core, and the policy's view of a sequence."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from aserve.engine.sequence import SeqState, SeqStatus
from scheduler import Policy, SeqView

if TYPE_CHECKING:
    from aserve.cores.ledger import BlockLedger
    from aserve.cores.lifecycle import Lifecycle
    from aserve.cores.wiring import Wiring
    from aserve.engine.config import SchedulerConfig


# -- base -----------------------------------------------------------------------------
# What the cores hand their drivers: KV moves and forward passes as data, the wiring
# between instances (one for both drivers), and the policy's view of a sequence.


@dataclass(frozen=True, slots=True)
class Move:
    """Copy `seq`'s KV from store `src` to store `dst` (the destination is already
    allocated); the driver copies, then calls the core's `landed` (or `failed`). Between
    two stores of one KV tensor (`handover`) nothing is copied: the destination's room is
    reserved, and the commit hands the block table over."""

    seq: SeqState
    src: str
    dst: str
    num_blocks: int
    # a fork (n > 1): the parent's block ids to copy from, in the same store (`src == dst`)
    src_ids: tuple[int, ...] | None = None
    handover: bool = False


@dataclass(frozen=True, slots=True)
class Forward:
    """One forward pass: compute `num_new_tokens[i]` more tokens of `seqs[i]`."""

    instance: str
    seqs: list[SeqState]
    num_new_tokens: list[int]
    start_time: float  # when the core issued it (the driver's clock)
    lengths: tuple[int, ...] = field(init=False)  # each seq's prefix once the step is done

    def __post_init__(self) -> None:
        object.__setattr__(self, "lengths", tuple(
            s.num_computed_tokens + n for s, n in zip(self.seqs, self.num_new_tokens)))


class Window(NamedTuple):
    """A decode instance's running length window, for dynamic prefetch."""

    lo: int
    hi: int
    max_blocks: int  # decode room the instance can accept for matching requests
    max_requests: int


# What the other cores tell the batcher, as named messages (`Wiring.to_batcher`).


@dataclass(frozen=True, slots=True)
class Pooled:
    """`seq`'s KV landed in the host pool: an offload, or a seq returned to the pool."""

    seq: SeqState


@dataclass(frozen=True, slots=True)
class WindowReport:
    """Decode instance `instance`'s running length window changed (dynamic prefetch)."""

    instance: int
    window: Window


@dataclass(frozen=True, slots=True)
class StagingFreed:
    """A decode instance freed staging room: its window may match again."""


@dataclass(frozen=True, slots=True)
class WantsBatch:
    """A decode instance's candidate batch buffer emptied (it sets `wants_batch`)."""


BatcherMessage = Pooled | WindowReport | StagingFreed | WantsBatch


class Core:
    """What every core offers its driver, whichever kind of instance it runs. The driver
    loops: `step(now)` says what must happen next, a `Forward` to run (then `finish`, whose
    returned moves it copies too), KV moves to copy one after another (each then `landed`
    or `failed`), or None (nothing until the driver is woken); `fail` ends what the core
    held when the driver's step raised."""

    waiting: Any  # an entry core's queue (prefill, colocated)
    running: list[SeqState]  # a decode (or colocated) core's running batch
    current_batch_id = -1  # a decode core's running batch (its iterations may mix two)
    prefilled = SeqStatus.PREFILLING  # a seq's status once its prefill has ended here
    # its driver lost the device (a node of a cluster): it takes no new work until back
    is_offline = False

    def __init__(self, ctx: Any, name: str, index: int = 0) -> None:
        """`ctx`: what the cores of one engine (or simulated cluster) share, the driver's
        context: `policy`, `kv` (a BlockLedger), `life`, `wiring`, `config.scheduler`."""
        self.name, self.index = name, index
        self.policy: Policy = ctx.policy
        self.kv: BlockLedger = ctx.kv
        self.life: Lifecycle = ctx.life
        self.wiring: Wiring = ctx.wiring
        self.sched: SchedulerConfig = ctx.config.scheduler  # budgets and knobs

    def step(self, now: float) -> Forward | list[Move] | None:
        raise NotImplementedError

    def submit(self, seq: SeqState, front: bool = False) -> None:
        raise NotImplementedError  # an entry core's (prefill, colocated)

    def finish(self, step: Forward, token_ids: list[int | None],
               logprobs: list[float | None], now: float, forward_time: float,
               schedule_time: float, fused: bool = False) -> list[Move]:
        """The forward ran (a decode or colocated step; prefill records first): outputs
        advance, the step is recorded, finished seqs leave the running batch. Returns the
        KV copies of samples forked from prompts whose prefill ended (`_advance`)."""
        num_prefill = sum(n for s, n in zip(step.seqs, step.num_new_tokens)
                          if s.status == SeqStatus.PREFILLING)
        forks = self._advance(step, token_ids, logprobs, now)
        self.life.record(step, forward_time, schedule_time, num_prefill, is_mixed=len(
            {s.batch_id == self.current_batch_id for s in step.seqs}) > 1, fused=fused)
        self.running = [s for s in self.running if not s.is_finished]
        return forks

    def landed(self, move: Move, now: float) -> None:
        raise NotImplementedError

    def failed(self, move: Move, error: str, now: float) -> None:
        """A copy failed: its destination is freed and that seq alone ends with an error."""
        self.life.kv.cancel(move)
        self.life.fail_all([move.seq], error, now)

    def fail(self, error: str, now: float) -> None:
        """The forward pass failed: the running batch runs it again, each seq once
        (`Lifecycle.retry_once`); a seq failing twice ends with an error."""
        self.running = self.life.retry_once(self.running, error, now)

    def _advance(self, step: Forward, token_ids: list[int | None],
                 logprobs: list[float | None], now: float) -> list[Move]:
        """The one path of a forward's outputs, every core's: each seq's computed prefix
        grows by its chunk and a seq that sampled gets its token. A prefill that ended
        forks its waiting samples (n > 1, `_fork`) first: the token may finish the seq and
        free the blocks the forks copy from; the seq then takes the core's `prefilled`
        status. Returns the forks' KV moves, which the driver copies in this order, so a
        later fork's destination never overwrites an earlier fork's source before it is
        read."""
        forks: list[Move] = []
        for seq, n, token_id, logprob in zip(step.seqs, step.num_new_tokens, token_ids,
                                             logprobs):
            was_prefill = seq.status == SeqStatus.PREFILLING
            seq.num_computed_tokens += n
            if token_id is None:
                continue  # a prefill chunk that samples nothing yet
            if was_prefill:
                self.life.event(seq.seq_id, "prefill_end", now)
                forks += self._fork(seq, now)
            if not seq.is_finished:
                if was_prefill:
                    self.life.transition(seq, self.prefilled)
                self.life.append_token(seq, token_id, logprob, now)
        return forks

    def _fork(self, seq: SeqState, now: float) -> list[Move]:
        """Starts the samples waiting on `seq`'s prefill (n > 1), right after it: each gets
        blocks in `seq`'s store for a copy of the prompt's KV but the last token, which it
        recomputes to draw its own first token, and a copy of the prompt logprobs. Called
        when the prefill step's outputs are recorded, before any of the step's first tokens
        is appended (that may free `seq`'s blocks); the driver copies the returned moves
        before its instance allocates again, then hands each landed fork to this core.

        Returns the forks' KV moves, each fork in `seq`'s status. The samples the store had
        no room for are submitted here again, first in line, to be prefilled on their own.
        A store raising ends that sample alone.
        """
        moves: list[Move] = []
        unforked: list[SeqState] = []
        for child in self.life.reap(seq.forks, now):
            child.num_computed_tokens = seq.num_prompt_tokens - 1  # all but the last token
            move = self.life.reserve(child, seq.location, seq, at=now)
            if move is not None:
                self.life.transition(child, seq.status)
                child.prompt_logprobs[:] = seq.prompt_logprobs
                moves.append(move)
            elif not child.is_finished:
                child.num_computed_tokens = 0
                unforked.append(child)
        seq.forks = []
        for child in reversed(unforked):
            self.submit(child, front=True)
        return moves


def seq_views(seqs: Iterable[SeqState], kv: BlockLedger) -> tuple[SeqView, ...]:
    """The policy's view of each of `seqs`, holding the KV blocks of its computed tokens;
    each has waited since its last token (the first comes from prefill), or since arrival
    before that."""
    return tuple(SeqView(s.seq_id, s.num_tokens, kv.blocks_for(s.num_computed_tokens),
                         s.request.arrival_time, s.batch_id,
                         s.token_times[-1] if s.token_times else None, s.num_returns,
                         s.num_output_tokens)
                 for s in seqs)

