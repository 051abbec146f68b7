"""The engine driver's shared parts: the context every actor of one engine shares, the actor
base class (an inbox and a `run()` loop that waits on it, never polls), and the wiring that
turns the cores' requests to one another into messages.

An actor's loop catches exceptions at its boundary: the sequences it was processing fail with
`finish_reason="error"`, their blocks are freed, and the loop goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from aserve.config import EngineConfig
from aserve.core import Sequence
from aserve.cores import Forward, Lifecycle, Move, Window
from aserve.kvspace import KVSpace
from aserve.messages import Deliver, Message, Pooled, RunningWindow, Stop, Submit, Wake, WantBatch
from aserve.runner import PenaltySettings, PromptLogprobs, StepResult, WorkItem
from scheduler import Policy

if TYPE_CHECKING:
    from aserve.actors.batcher import BatcherActor
    from aserve.actors.prefill import PrefillActor

logger = logging.getLogger(__name__)


class Runner(Protocol):
    """What the actors need of a model runner (aserve.runner.ModelRunner, or a test's)."""

    async def execute(self, items: list[WorkItem], kv_cache: object) -> StepResult: ...

    def shutdown(self) -> None: ...


@dataclass
class EngineContext:
    """What the actors of one engine share: config, KV space, runners, policy, lifecycle,
    and each other's addresses (to send messages, never to call into internals)."""

    config: EngineConfig
    kv: KVSpace
    runners: dict[str, Runner]  # by device string
    policy: Policy
    outputs: Lifecycle
    max_model_len: int
    clock: Callable[[], float] = time.perf_counter  # the engine driver's one clock
    prefill: list[PrefillActor] = field(default_factory=list)
    decode: list[Actor] = field(default_factory=list)
    batcher: BatcherActor | None = None

    def now(self) -> float:
        return self.clock()


class EngineWiring:
    """`aserve.cores.Wiring` as messages between the actors of one engine."""

    def __init__(self, ctx: EngineContext) -> None:
        self.ctx = ctx

    def _batcher(self) -> BatcherActor:
        assert self.ctx.batcher is not None, "disaggregated engine has a batcher"
        return self.ctx.batcher

    def pooled(self, seq: Sequence) -> None:
        self._batcher().send(Pooled(seq))

    def want_batch(self, instance: int) -> None:
        self._batcher().send(WantBatch(instance))

    def report_window(self, instance: int, window: Window) -> None:
        self._batcher().send(RunningWindow(instance, window))

    def deliver(self, instance: int, batch_id: int, seqs: list[Sequence]) -> None:
        self.ctx.decode[instance].send(Deliver(batch_id, seqs))

    def pool_space(self) -> None:
        for actor in self.ctx.prefill:
            if actor.core.blocked:
                actor.send(Wake())

    def staging_space(self, instance: int) -> None:
        self._batcher().send(Wake())

    def recompute(self, seq: Sequence) -> None:
        target = min(self.ctx.prefill, key=lambda actor: actor.core.num_waiting_tokens)
        target.send(Submit(seq, front=True))


class Actor:
    """Inbox plus run loop; subclasses implement `receive` and `act`."""

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

    @property
    def has_work(self) -> bool:
        """Whether `act` has something to do now (else the loop waits for a message)."""
        return False

    async def run(self) -> None:
        while True:
            if not self.has_work and self._take(await self.inbox.get()):
                return
            while not self.inbox.empty():
                if self._take(self.inbox.get_nowait()):
                    return
            try:
                await self.act()
            except Exception as exc:  # the actor's boundary: log, fail what it held, go on
                self.on_error(self.record_error(exc))

    def _take(self, message: Message) -> bool:
        if isinstance(message, Stop):
            return True
        self.receive(message)
        return False

    def receive(self, message: Message) -> None:
        """Applies one message to the actor's core (no awaits)."""

    async def act(self) -> None:
        """Does what the core asks for now, awaiting forwards and copies."""

    def on_error(self, error: str) -> None:
        """Fails what the actor held when `act` raised."""

    def record_error(self, exc: BaseException) -> str:
        """Logs an exception caught at the actor's boundary and returns its message."""
        self.num_errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        logger.error("%s failed: %s\n%s", self.name, self.last_error,
                     "".join(traceback.format_exception(exc)))
        return self.last_error

    async def forward(self, step: Forward, kv_cache: object, runner: Runner) -> StepResult:
        """Runs `step` on the device's worker thread (the engine's one way to compute)."""
        items = [work_item(s, self.ctx.kv.table(s), n)
                 for s, n in zip(step.seqs, step.num_new_tokens)]
        return await runner.execute(items, kv_cache)

    async def wait(self) -> None:
        """Nothing can run now: waits for the next message instead of spinning."""
        if self._take(await self.inbox.get()):
            self.stop()

    async def carry_out(self, move: Move, landed: Callable[[Move, float], None],
                        failed: Callable[[Move, str, float], None]) -> bool:
        """Copies one KV move, then tells its core: `landed(move, now)`, or on a failed
        copy `failed(move, error, now)` (that seq alone ends with an error)."""
        try:
            await self.ctx.kv.copy(move, self.ctx.clock)
        except Exception as exc:
            failed(move, self.record_error(exc), self.ctx.now())
            return False
        landed(move, self.ctx.now())
        return True

    async def carry_out_forks(self, forks: list[Move],
                              landed: Callable[[Move, float], None]) -> None:
        """Copies the KV of the samples forked from a prefill (n > 1), before anything else
        runs on this instance's store; a sample whose copy fails ends alone with an error."""
        life = self.ctx.outputs
        for move in forks:
            await self.carry_out(move, landed, lambda m, error, t: life.fail_move(m, error, at=t))


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
