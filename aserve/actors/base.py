"""The actor base class and the context every actor of one engine shares.

An actor owns an inbox and a `run()` loop that waits on it (never polls). Its loop catches
exceptions at the boundary: the sequences it was processing fail with `finish_reason="error"`,
their blocks are freed, and the loop goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aserve.config import EngineConfig
from aserve.core import SeqStatus, Sequence
from aserve.kvspace import KVSpace
from aserve.messages import Message, PoolSpace, Stop
from aserve.outputs import Outputs
from aserve.runner import ModelRunner, PenaltySettings, PromptLogprobs, WorkItem
from scheduler import Policy, SeqView

if TYPE_CHECKING:
    from aserve.actors.batcher import BatcherActor
    from aserve.actors.decode import DecodeActor
    from aserve.actors.pool import PoolActor
    from aserve.actors.prefill import PrefillActor

logger = logging.getLogger(__name__)


@dataclass
class EngineContext:
    """What the actors of one engine share: config, KV space, runners, policy, outputs,
    and each other's addresses (to send messages, never to call into internals)."""

    config: EngineConfig
    kv: KVSpace
    runners: dict[str, ModelRunner]  # by device string
    policy: Policy
    outputs: Outputs
    max_model_len: int
    prefill: list[PrefillActor] = field(default_factory=list)
    decode: list[DecodeActor] = field(default_factory=list)
    pool: PoolActor | None = None
    batcher: BatcherActor | None = None

    def notify_pool_space(self) -> None:
        """Wakes prefill actors held back by a full host pool."""
        for actor in self.prefill:
            if actor.blocked:
                actor.send(PoolSpace())


class Actor:
    """Inbox plus run loop; subclasses implement `handle` (and may override `run`)."""

    name = "actor"

    def __init__(self, ctx: EngineContext) -> None:
        self.ctx = ctx
        self.inbox: asyncio.Queue[Message] = asyncio.Queue()
        self.last_error: str | None = None
        self.num_errors = 0

    def send(self, message: Message) -> None:
        self.inbox.put_nowait(message)

    def stop(self) -> None:
        self.send(Stop())

    async def run(self) -> None:
        while True:
            message = await self.inbox.get()
            if isinstance(message, Stop):
                return
            try:
                await self.handle(message)
            except Exception as exc:  # the actor's boundary: log, fail what it held, go on
                self.record_error(exc)

    async def handle(self, message: Message) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement handle()")

    def record_error(self, exc: BaseException) -> str:
        """Logs an exception caught at the actor's boundary and returns its message."""
        self.num_errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        logger.error("%s failed: %s\n%s", self.name, self.last_error,
                     "".join(traceback.format_exception(exc)))
        return self.last_error

    def fail(self, seqs: Iterable[Sequence], error: str) -> None:
        """Ends `seqs` with finish_reason="error" and frees their blocks."""
        for seq in seqs:
            self.finish(seq, SeqStatus.FINISHED_ERROR, error)

    def finish(self, seq: Sequence, status: SeqStatus, error: str | None = None) -> None:
        """Ends `seq` and frees every block it holds (exactly once)."""
        self.ctx.kv.release(seq)
        self.ctx.outputs.finish(seq, status, error)

    async def move(self, seq: Sequence, dst_name: str) -> bool:
        """`KVSpace.move`, except that a failed copy (or a store refusing the allocation)
        fails `seq` alone: it ends with finish_reason="error" and its blocks are freed.

        Returns False when the destination is full or the move failed; the caller tells the
        two apart by `seq.is_finished`."""
        try:
            return await self.ctx.kv.move(seq, dst_name)
        except Exception as exc:
            self.finish(seq, SeqStatus.FINISHED_ERROR, self.record_error(exc))
            return False

    async def spawn_forks(self, seq: Sequence) -> tuple[list[Sequence], list[Sequence]]:
        """Starts the samples waiting on `seq`'s prefill (n > 1), right after it: each gets a
        copy of the prompt's KV but the last token, which it recomputes to draw its own first
        token. Call before `seq`'s first token is appended (its KV may be freed then).

        Returns (forks that hold KV, in `seq`'s status; forks the store had no room for,
        to be prefilled on their own). A fork whose copy fails ends with an error.
        """
        forked: list[Sequence] = []
        unforked: list[Sequence] = []
        num_cached = seq.num_prompt_tokens - 1
        for child in self.reap(seq.forks):
            try:
                has_kv = await self.ctx.kv.fork(seq, child, num_cached)
            except Exception as exc:
                self.finish(child, SeqStatus.FINISHED_ERROR, self.record_error(exc))
                continue
            if has_kv:
                child.num_computed_tokens, child.status = num_cached, seq.status
                child.prompt_logprobs[:] = seq.prompt_logprobs
            (forked if has_kv else unforked).append(child)
        seq.forks = []
        return forked, unforked

    def reap(self, seqs: list[Sequence]) -> list[Sequence]:
        """Finishes the sequences an abort or stop string asked to end, frees their blocks,
        and returns those still live, in order."""
        live = []
        for seq in seqs:
            status = self.ctx.outputs.requested_status(seq)
            if status is not None:
                self.finish(seq, status)
            elif seq.is_finished:
                self.ctx.kv.release(seq)
            else:
                live.append(seq)
        return live


def work_item(seq: Sequence, block_table: list[int], num_new_tokens: int) -> WorkItem:
    """The runner's view of computing `num_new_tokens` more of `seq`'s tokens."""
    start = seq.num_computed_tokens
    end = start + num_new_tokens
    params = seq.sampling
    return WorkItem(
        token_ids=seq.token_ids[start:end],
        start=start,
        block_table=block_table,
        do_sample=end == seq.num_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=params.seed,
        step=seq.num_output_tokens,
        penalties=PenaltySettings(
            params.presence_penalty, params.frequency_penalty, params.repetition_penalty,
            params.logit_bias, seq.token_ids, seq.num_prompt_tokens,
        ) if params.has_penalties else None,
        prompt_logprobs=PromptLogprobs(seq.token_ids, seq.num_prompt_tokens,
                                       seq.prompt_logprobs) if params.prompt_logprobs else None,
    )


def seq_view(seq: Sequence, num_blocks: int) -> SeqView:
    """The policy's view of a sequence holding `num_blocks` KV blocks; it has waited since
    its last token (the first comes from prefill), or since arrival before that."""
    return SeqView(seq.seq_id, seq.num_tokens, num_blocks, seq.request.arrival_time,
                   seq.batch_id, seq.token_times[-1] if seq.token_times else None)


def now() -> float:
    return time.perf_counter()
