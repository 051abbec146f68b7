"""The scheduling cores: one I/O-free state machine per kind of instance, driven by the
asyncio engine (aserve/driver.py) and by the discrete-event simulator (sim/drivers.py) alike.

A core takes the current time as an argument and returns what must happen next: forward
passes with their batch, KV moves with source, destination and blocks, lifecycle events.
No asyncio, no torch, no clock here: the driver owns time, devices and copies.

One request's state lives here and nowhere else: its status and lifecycle events are
written by `Lifecycle` (the one finish path), its KV blocks are counted by `BlockLedger`.
Sections, in the order a request meets them: the data the cores hand their drivers and
the `Wiring` between instances; `BlockLedger`; `Lifecycle`; `PrefillCore`; `BatcherCore`
(host pool + batch generator); `DecodeCore` (the boundary rules); `ColocatedCore` (the
`continuous` baseline).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from sortedcontainers import SortedKeyList

from aserve.core import (
    Event,
    EventKind,
    IterationRecord,
    SeqStatus,
    Sequence,
    StepOutput,
    TransferRecord,
)
from scheduler import (
    BoundaryPlan,
    BoundaryView,
    ContinuousScheduler,
    ContinuousSeq,
    Policy,
    SeqView,
    ceil_div,
)
from transport.blocks import allocators_for

if TYPE_CHECKING:
    from aserve.config import SchedulerConfig

logger = logging.getLogger(__name__)
LOCATIONS = ("prefill", "staging", "host", "decode")
MATCH_STAGING_SHARE = 0.5  # at most this share of free staging goes to matching requests


# -- base -----------------------------------------------------------------------------
# What the cores hand their drivers: KV moves and forward passes as data, the wiring
# between instances (one for both drivers), and the policy's view of a sequence.


@dataclass(frozen=True, slots=True)
class Move:
    """Copy `seq`'s KV from store `src` to store `dst` (the destination is already
    allocated); the driver copies, then calls the core's `landed` (or `failed`). Between
    two stores of one KV tensor (`handover`) nothing is copied: the destination's room is
    reserved, and the commit hands the block table over."""

    seq: Sequence
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
    seqs: list[Sequence]
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


class Core:
    """What every core offers its driver, whichever kind of instance it runs. The driver
    loops: `step(now)` says what must happen next, a `Forward` to run (then `finish`, whose
    returned moves it copies too), KV moves to copy one after another (each then `landed`
    or `failed`), or None (nothing until the driver is woken); `fail` ends what the core
    held when the driver's step raised."""

    waiting: Any  # an entry core's queue (prefill, colocated)
    running: list[Sequence]  # a decode (or colocated) core's running batch
    current_batch_id = -1  # a decode core's running batch (its iterations may mix two)
    prefilled = SeqStatus.PREFILLING  # a seq's status once its prefill has ended here

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

    def submit(self, seq: Sequence, front: bool = False) -> None:
        raise NotImplementedError  # an entry core's (prefill, colocated)

    def finish(self, step: Forward, token_ids: list[int | None],
               logprobs: list[float | None], now: float, forward_time: float,
               schedule_time: float) -> list[Move]:
        """The forward ran (a decode or colocated step; prefill records first): outputs
        advance, the step is recorded, finished seqs leave the running batch. Returns the
        KV copies of samples forked from prompts whose prefill ended (`_advance`)."""
        num_prefill = sum(n for s, n in zip(step.seqs, step.num_new_tokens)
                          if s.status == SeqStatus.PREFILLING)
        forks = self._advance(step, token_ids, logprobs, now)
        self.life.record(step, forward_time, schedule_time, num_prefill, is_mixed=len(
            {s.batch_id == self.current_batch_id for s in step.seqs}) > 1)
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
                    seq.status = self.prefilled
                self.life.append_token(seq, token_id, logprob, now)
        return forks

    def _fork(self, seq: Sequence, now: float) -> list[Move]:
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
        unforked: list[Sequence] = []
        for child in self.life.reap(seq.forks, now):
            child.num_computed_tokens = seq.num_prompt_tokens - 1  # all but the last token
            move = self.life.reserve(child, seq.location, seq, at=now)
            if move is not None:
                child.status = seq.status
                child.prompt_logprobs[:] = seq.prompt_logprobs
                moves.append(move)
            elif not child.is_finished:
                child.num_computed_tokens = 0
                unforked.append(child)
        seq.forks = []
        for child in reversed(unforked):
            self.submit(child, front=True)
        return moves


class Driver(Protocol):
    """What the wiring needs of an instance's driver (an asyncio actor, a simulated
    instance): its core, and a way to wake it (it acts on the core's new state once free)."""

    core: Any

    def wake(self) -> None: ...


class Wiring:
    """How the cores of one engine (or one simulated cluster) reach one another, for both
    drivers: each call updates the receiving core at once and wakes its driver."""

    def __init__(self) -> None:
        self.prefills: list[Driver] = []  # drivers of PrefillCores
        self.batcher: Driver | None = None  # the BatcherCore's (disaggregated policies)
        self.decodes: list[Driver] = []  # drivers of DecodeCores, or of ColocatedCores

    @property
    def drivers(self) -> list[Driver]:
        return [*self.prefills, *filter(None, [self.batcher]), *self.decodes]

    def to_batcher(self, call: Callable[[BatcherCore], object] = lambda core: None) -> None:
        """Tells the batcher (`call` on its core at once) and wakes it: a seq pooled, a
        decode instance wanting a batch (no call), a window reported, staging room freed."""
        assert self.batcher is not None, "the disaggregated cluster has a batcher"
        call(self.batcher.core)
        self.batcher.wake()

    def connect(self, drive: Callable[[Core, str | None], Driver], ctx: Any,
                decode_devices: Sequence_[str]) -> None:
        """Builds the cores of `ctx.policy` (one colocated instance per decode device if it
        uses no pool; else prefill instances, the batcher and decode instances) over the
        driver's context `ctx` (see `Core`; its `config` is the engine's EngineConfig or the
        simulator's cluster, which names the prefill devices), each in its driver
        `drive(core, device)` (no device for the batcher), and starts them (the batcher is
        woken for the decode instances' first batches)."""
        pool = ctx.policy.uses_pool
        if pool:
            self.prefills = [drive(PrefillCore(ctx, i), dev)
                             for i, dev in enumerate(ctx.config.prefill_devices)]
            self.batcher = drive(BatcherCore(ctx), None)
        core = DecodeCore if pool else ColocatedCore
        self.decodes = [drive(core(ctx, j), dev) for j, dev in enumerate(decode_devices)]
        if self.batcher is not None:
            self.batcher.wake()  # every decode instance starts out wanting a batch

    def submit(self, seq: Sequence, front: bool = False) -> None:
        """A new request (or one to prefill again, `front` first in line) goes to the
        entry instance with the fewest waiting tokens (prefill, or colocated)."""
        entry = self.prefills or self.decodes
        target = min(entry, key=lambda driver: sum(s.num_tokens for s in driver.core.waiting))
        target.core.submit(seq, front)
        target.wake()

    def reap(self, now: float) -> None:
        """An abort was asked: idle holders end the request now, the others at their next
        step (`Lifecycle.abort`)."""
        for driver in self.drivers:
            driver.core.reap(now)

    def deliver(self, instance: int, batch_id: int, seqs: list[Sequence]) -> None:
        """Staged seqs for decode instance `instance`: a candidate batch, or candidate
        requests when `batch_id` < 0."""
        self.decodes[instance].core.receive(batch_id, seqs)
        self.decodes[instance].wake()

    def pool_space(self) -> None:
        """Host-pool blocks were freed: prefill held back by a full pool may go on."""
        for prefill in self.prefills:
            if prefill.core.blocked:
                prefill.wake()


def seq_views(seqs: Iterable[Sequence], kv: BlockLedger) -> tuple[SeqView, ...]:
    """The policy's view of each of `seqs`, holding the KV blocks of its computed tokens;
    each has waited since its last token (the first comes from prefill), or since arrival
    before that."""
    return tuple(SeqView(s.seq_id, s.num_tokens, kv.blocks_for(s.num_computed_tokens),
                         s.request.arrival_time, s.batch_id,
                         s.token_times[-1] if s.token_times else None, s.num_returns)
                 for s in seqs)


def kv_stores(prefill_devices: Sequence_[str], decode_devices: Sequence_[str],
              cache: Any, host_blocks: int) -> dict[str, tuple[str, int]]:
    """Every KV store, by name, with its device and its blocks (from `cache`, the engine's
    CacheConfig or the simulator's cluster): `prefill{i}` scratch on prefill device i;
    decode instance j's cache `decode{j}` and its candidate buffer `staging{j}` on prefill
    device j mod P (the paper's layout); the `host` pool of `host_blocks` in CPU memory. One
    layout, both drivers."""
    stores = {f"prefill{i}": (dev, cache.num_prefill_blocks)
              for i, dev in enumerate(prefill_devices)}
    for j, dev in enumerate(decode_devices):
        stores[f"decode{j}"] = (dev, cache.num_decode_blocks)
        stores[f"staging{j}"] = (prefill_devices[j % len(prefill_devices)],
                                 max(cache.num_staging_blocks, 1))
    stores["host"] = ("cpu", host_blocks)
    return stores


# -- kv -------------------------------------------------------------------------------
# BlockLedger: the block tables of every KV store of one engine (or simulated cluster), by
# store name, and the bookkeeping of a KV move (reserve, then commit or cancel).
#
# Integers only: the engine's KVSpace (aserve/driver.py) adds the tensors and the copies.


class BlockLedger:
    """`prefill{i}` scratch, `staging{j}` candidate buffers, one `host` pool, `decode{j}`
    caches. A sequence's `location` names the store whose table holds its KV."""

    def __init__(self, stores: Mapping[str, tuple[str, int]], block_size: int,
                 share_memory: bool) -> None:
        """An allocator per store of `stores` (`kv_stores`); with `share_memory` the stores
        on one device draw from one `BlockPool` (one KV tensor), each within its own
        blocks, and a move between two of them is a hand-over."""
        self.allocators = allocators_for(stores, block_size, share_memory)
        self.block_size = block_size
        self.transfers: list[TransferRecord] = []  # every completed move, for research

    def blocks_for(self, num_tokens: int) -> int:
        return ceil_div(num_tokens, self.block_size)

    def free_blocks(self, name: str) -> int:
        return self.allocators[name].num_free

    def allocate(self, seq: Sequence, name: str, num_tokens: int) -> bool:
        """Gives `seq` fresh blocks in store `name`; False (nothing changed) when full."""
        assert not seq.location, f"{seq.seq_id} already holds KV in {seq.location}"
        if self.allocators[name].allocate(seq.seq_id, num_tokens) is None:
            return False
        seq.location = name
        return True

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Extends `seq`'s table in its store to cover `num_tokens`; False when full."""
        return self.allocators[seq.location].grow(seq.seq_id, num_tokens) is not None

    def table(self, seq: Sequence) -> list[int]:
        return self.allocators[seq.location].table(seq.seq_id)

    def release(self, seq: Sequence) -> None:
        """Frees every block `seq` holds, wherever it is; a no-op when it holds none."""
        if seq.location:
            self.allocators[seq.location].free(seq.seq_id)
            seq.location = ""

    def reserve(self, seq: Sequence, dst: str, parent: Sequence | None = None) -> Move | None:
        """Allocates room for `seq`'s KV (its `num_computed_tokens` entries) in store `dst`;
        None (nothing changed) when `dst` is full. The source keeps the KV until `commit`.
        Where both stores share one KV tensor, the room is only reserved (a hand-over).

        With `parent` (a fork: n samples of one prompt share its prefill), `seq` holds no KV
        yet and gets a copy of the parent's first entries in the parent's store, `dst`. The
        move's source ids are taken now: the driver copies before anything allocates in
        that store again, even if the parent has finished (and freed its blocks) meanwhile.
        """
        source = parent or seq
        assert source.location and seq.location != dst, f"{seq.seq_id}: bad move to {dst}"
        taken = self.allocators[dst].take(seq.seq_id, max(seq.num_computed_tokens, 1),
                                          None if parent else self.allocators[seq.location])
        if taken is None:
            return None
        num_blocks, handover = taken
        src_ids = tuple(self.table(parent)[:num_blocks]) if parent else None
        return Move(seq, source.location, dst, num_blocks, src_ids, handover)

    def tables(self, move: Move) -> tuple[list[int], list[int]]:
        """(source ids, destination ids) of a copy `move`, aligned block for block."""
        dst_ids = self.allocators[move.dst].table(move.seq.seq_id)
        if move.src_ids is not None:
            return list(move.src_ids), dst_ids
        return self.allocators[move.src].table(move.seq.seq_id)[: len(dst_ids)], dst_ids

    def commit(self, move: Move, start_time: float, end_time: float) -> None:
        """The copy landed: the source blocks are freed (a fork's belong to its parent and
        stay) and `seq` lives in `dst`; a hand-over's table changes stores."""
        if move.handover:
            self.allocators[move.dst].adopt(move.seq.seq_id, self.allocators[move.src])
        elif move.src_ids is None:
            self.allocators[move.src].free(move.seq.seq_id)
        move.seq.location = move.dst
        self.transfers.append(TransferRecord(move.seq.seq_id, move.src, move.dst,
                                             move.num_blocks, start_time, end_time))

    def cancel(self, move: Move) -> None:
        """The copy failed: the destination blocks are freed, the source keeps the KV (a
        fork then holds none)."""
        self.allocators[move.dst].free(move.seq.seq_id)  # a hand-over's reservation too

    def limits(self, uses_pool: bool) -> dict[str, int]:
        """The most blocks one request may hold, by the setting that sets it: every store it
        passes through, or it could never finish. NOTE: one above the batch share of decode
        KV gets the whole cache, and one larger than the staging buffer stays in the host pool
        until admitted (so staging sets no limit)."""
        stores = {"num_decode_blocks": "decode0"}
        if uses_pool:
            stores |= {"num_prefill_blocks": "prefill0", "the host pool": "host"}
        return {name: self.allocators[store].num_blocks for name, store in stores.items()}

    def check_fits(self, num_tokens: int, uses_pool: bool, what: str) -> None:
        """Raises ValueError naming `what` and the limit when `num_tokens` exceed one."""
        num_blocks = self.blocks_for(num_tokens)
        for name, limit in self.limits(uses_pool).items():
            if num_blocks > limit:
                raise ValueError(f"{what} ({num_tokens} tokens) needs {num_blocks} KV blocks "
                                 f"but {name} is {limit}")

    def usage(self) -> dict[str, tuple[int, int]]:
        """(used, total) blocks per location kind, summed over instances."""
        out = {loc: (0, 0) for loc in LOCATIONS}
        for name, allocator in self.allocators.items():
            kind = name.rstrip("0123456789")
            used, total = out[kind]
            out[kind] = (used + allocator.num_used, total + allocator.num_blocks)
        return out

    def blocks_used(self) -> dict[str, int]:
        return {loc: used for loc, (used, _) in self.usage().items()}

    def check_integrity(self) -> None:
        for allocator in self.allocators.values():
            allocator.check_integrity()


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
        self.on_finish: Callable[[Sequence], None] = lambda seq: None  # the driver's bookkeeping
        self.num_finished = 0
        self.retried: set[str] = set()  # seqs whose forward failed once (`retry_once`)

    def _keep(self, trace: list[Any], item: object) -> int:
        """Appends `item`; past `trace_limit` the older half is dropped (a long-running
        server must not grow forever). Returns how many were dropped."""
        trace.append(item)
        if self.trace_limit is None or len(trace) <= self.trace_limit:
            return 0
        half = self.trace_limit // 2
        del trace[:half]
        return half

    def event(self, seq_id: str, kind: EventKind, at: float) -> None:
        self._keep(self.events, Event(seq_id, kind, at))

    def iteration(self, record: IterationRecord) -> None:
        self.num_dropped_iterations += self._keep(self.iterations, record)

    def record(self, step: Forward, forward_time: float, schedule_time: float,
               num_prefill_tokens: int = 0, is_mixed: bool = False,
               packed: bool = False) -> None:
        """Records one forward pass; a prefill instance's (`packed` prompts) apart."""
        record = IterationRecord(
            step.instance, step.start_time, len(step.seqs), num_prefill_tokens,
            min(step.lengths), max(step.lengths), forward_time, schedule_time, is_mixed,
            self.kv.blocks_used(), step.lengths, tuple(step.num_new_tokens))
        if packed:
            self._keep(self.prefill_iterations, record)
        else:
            self.iteration(record)

    def append_token(self, seq: Sequence, token_id: int, logprob: float | None,
                     at: float) -> None:
        """Appends one sampled token, records its event, streams it, and finishes the
        sequence if a stop condition holds (a stop token or EOS once `min_tokens` are out,
        else `max_tokens`)."""
        first = seq.num_output_tokens == 0
        seq.append_token(token_id, at, logprob if seq.sampling.logprobs else None)
        if first:
            self.event(seq.seq_id, "first_token", at)
        elif self.record_tokens:
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
        if release:
            self.kv.release(seq)
        self.retried.discard(seq.seq_id)
        if seq.is_finished:
            return
        seq.status, seq.error = status, error
        self.num_finished += 1
        for child in seq.forks:  # samples that were to start from its prefill
            self.finish(child, status, error, at=at)
        seq.forks = []
        self.event(seq.seq_id, "finish", at)
        self.finish_requests.pop(seq.seq_id, None)
        if (queue := self.queues.pop(seq.seq_id, None)) is not None:
            queue.put_nowait(StepOutput(seq.seq_id, (), (), at, True, seq.finish_reason, error))
        self.on_finish(seq)

    def reserve(self, seq: Sequence, dst: str, parent: Sequence | None = None, *,
                at: float) -> Move | None:
        """`BlockLedger.reserve`, except that a store refusing the allocation by raising
        ends `seq` alone with an error (check `seq.is_finished` after None)."""
        try:
            return self.kv.reserve(seq, dst, parent)
        except Exception as exc:  # a store's failure is this seq's, not the instance's
            logger.exception("allocating KV for %s failed", seq.seq_id)
            self.fail_all([seq], f"{type(exc).__name__}: {exc}", at)
            return None

    def retry_once(self, seqs: Iterable[Sequence], error: str, at: float) -> list[Sequence]:
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

    def fail_all(self, seqs: Iterable[Sequence], error: str, at: float) -> None:
        """Ends each of `seqs` with `error` (a failed forward, copy or store)."""
        for seq in seqs:
            self.finish(seq, SeqStatus.FINISHED_ERROR, error, at=at)


# -- prefill --------------------------------------------------------------------------
# PrefillCore: one prefill instance. Packs waiting prompts under a token budget into one
# forward pass; each prefilled request's KV then goes to the host pool, in order, while the
# pool has room (backpressure: no prefill starts while an offload waits for room).


class PrefillCore(Core):
    """A waiting queue, a scratch KV store, and the prefilled seqs waiting for the pool."""

    def __init__(self, ctx: Any, index: int) -> None:
        super().__init__(ctx, f"prefill{index}", index)
        self.waiting: deque[Sequence] = deque()
        self.blocked: deque[Sequence] = deque()  # prefilled; waiting for host-pool room
        self.prefilling: list[Sequence] = []  # the forward in flight

    def submit(self, seq: Sequence, front: bool = False) -> None:
        """A new (or recompute-evicted) request; `front` puts it first in line."""
        seq.status = SeqStatus.WAITING
        (self.waiting.appendleft if front else self.waiting.append)(seq)

    def reap(self, now: float) -> None:
        """Ends the waiting seqs an abort asked to end (they hold no KV)."""
        self.waiting = deque(self.life.reap(list(self.waiting), now))

    def step(self, now: float) -> Forward | list[Move] | None:
        """Prefilled KV goes to the host pool first, one seq at a time (aborted ones end
        here); no prefill starts while the pool is full (`pool_space` wakes the driver).
        Then the next prefill."""
        while self.blocked:
            seq = self.blocked[0]
            move = self.life.reserve(seq, "host", at=now) if self.life.reap([seq], now) else None
            if move is None and not seq.is_finished:
                return None
            self.blocked.popleft()
            if move is not None:
                return [move]
        return self.forward(now) if self.waiting else None

    def forward(self, now: float) -> Forward | None:
        """The next packed prefill: waiting seqs up to the token budget whose KV fits."""
        self.reap(now)
        budget = self.sched.max_prefill_tokens
        batch: list[Sequence] = []
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
            seq.status = SeqStatus.PREFILLING
            self.life.event(seq.seq_id, "prefill_start", now)
        return Forward(self.name, batch, [seq.num_tokens for seq in batch], now)

    def finish(self, step: Forward, token_ids: list[int | None],
               logprobs: list[float | None], now: float, forward_time: float,
               schedule_time: float) -> list[Move]:
        """The prefill ran: first tokens (TTFT); live seqs wait to be offloaded. Returns the
        KV copies of the samples forked from these prompts (n > 1), which the driver carries
        out before anything else."""
        self.prefilling = []
        self.life.record(step, forward_time, schedule_time, sum(step.num_new_tokens),
                         packed=True)
        forks = self._advance(step, token_ids, logprobs, now)
        self.blocked.extend(seq for seq in step.seqs if not seq.is_finished)
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
        self.wiring.to_batcher(lambda batcher: batcher.add(seq))


# -- batcher --------------------------------------------------------------------------
# BatcherCore: the host pool (its sequences, indexed by the policy) and the batch
# generator. Whenever a decode instance's candidate batch buffer is empty it takes the
# policy's next batch from the pool; it also takes pool requests matching a running batch's
# length window (dynamic prefetch). Each order is staged seq by seq into the instance's
# staging buffer on the prefill device, then delivered. The choices are the policy's.


@dataclass(slots=True)
class Order:
    """Seqs taken from the pool for one decode instance: its next candidate batch, or
    candidate requests (batch_id < 0); staged one by one (`index`), then delivered."""

    instance: int
    batch_id: int
    seqs: list[Sequence]
    index: int = 0
    moved: list[Sequence] = field(default_factory=list)
    moving: Move | None = None  # its copy in flight


class BatcherCore(Core):
    """Pooled seqs, the decode instances waiting for a batch, and their running windows."""

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx, "batcher")
        self.num_decode_blocks = self.kv.allocators["decode0"].num_blocks
        # NOTE: a batch's budget is a share of the decode cache, not capped by free staging:
        # what the staging buffer cannot take stays in the host pool and is copied straight
        # to decode when admitted, so no request is too big to batch.
        self.batch_blocks = int(self.num_decode_blocks * self.sched.batch_kv_fraction)
        self.seqs: dict[str, Sequence] = {}
        self.windows: dict[int, Window] = {}
        self.pending: set[int] = set()  # instances whose window wants a matching pass
        self.num_batches = 0
        self.orders: list[Order] = []  # being staged

    def step(self, now: float) -> list[Move] | None:
        """The next staging copy of an order whose last copy has landed (an order all
        staged is delivered), else the first of a new order; None when there is nothing to
        do. A driver may copy for several orders at once (each link queues its own)."""
        while True:
            order = next((o for o in self.orders if o.moving is None), None)
            if order is None:
                if (order := self.next_order(now)) is None:
                    return None
                self.orders.append(order)
            order.moving = self.next_move(order, now)
            if order.moving is not None:
                return [order.moving]
            self.orders.remove(order)
            self.deliver(order, now)

    def _landing(self, move: Move) -> Order:
        order = next(o for o in self.orders if o.moving is move)
        order.moving = None
        return order

    def failed(self, move: Move, error: str, now: float) -> None:
        self._landing(move)
        super().failed(move, error, now)

    def fail(self, error: str, now: float) -> None:
        """The orders being staged end with an error."""
        for order in self.orders:
            self.life.fail_all(order.seqs, error, now)
        self.orders = []

    def add(self, seq: Sequence) -> None:
        """`seq`'s KV landed in the host pool: it is pooled, indexed by the policy."""
        assert seq.location == "host", f"{seq.seq_id} pooled without host KV ({seq.location})"
        seq.status = SeqStatus.POOLED
        self.seqs[seq.seq_id] = seq
        self.policy.add(seq_views([seq], self.kv)[0])
        self.pool_changed()

    def pool_changed(self) -> None:
        """The pool gained requests or staging room was freed: windows may match again
        (only a policy with dynamic prefetch has windows reported)."""
        self.pending.update(self.windows)

    def reap(self, now: float) -> None:
        """Ends the pooled seqs an abort asked to end, freeing their host blocks."""
        ended = [s for s in self.seqs.values() if s.seq_id in self.life.finish_requests]
        for seq in ended:
            self._remove(seq)
        if ended:
            self.life.reap(ended, now)
            self.wiring.pool_space()

    def report_window(self, instance: int, window: Window) -> None:
        self.windows[instance] = window
        self.pending.add(instance)

    def next_order(self, now: float) -> Order | None:
        """A batch for the first waiting instance, if the pool can fill one, else matching
        requests for the first window that asks; None when there is nothing to do. An
        instance waits while it `wants_batch` and none is being staged for it (a second
        batch would overwrite the first)."""
        staging = {order.instance for order in self.orders if order.batch_id >= 0}
        waiting = next((i for i, decode in enumerate(self.wiring.decodes)
                        if decode.core.wants_batch and i not in staging), None)
        if waiting is not None and self.seqs:
            # NOTE: the policy's batch does not depend on the instance (`next_batch` is a
            # query of the pool), so only the first waiting instance is asked for
            batch = self.sched.max_batch_size
            ids = self.policy.next_batch(self.batch_blocks, batch, now)
            if not ids:  # only requests above the share: give one the whole cache
                ids = self.policy.next_batch(self.num_decode_blocks, batch, now)
            if ids:
                self.num_batches += 1
                return self._take(waiting, self.num_batches, ids)
        for instance in self.match_order():
            self.pending.discard(instance)
            if (order := self._match(instance, now)) is not None:
                return order
        return None

    def match_order(self) -> list[int]:
        """The instances whose window wants a matching pass, the one with the most room
        first (free batch slots, then decode blocks; ties by index).

        NOTE: benchmarks/RESULTS.md §23. In index order, decode0's window had the first pick
        of every request the pool gained, and with several decode instances it ran the
        largest batches and ended last: in the simulator (OPT-13B, 8 x H100, per-seq
        kernel, synthetic backlog at 4+4) `aligned`'s four instances averaged 57, 29, 32
        and 22 seqs per step and decode0 set the makespan (0.95x fcfs); with the most room
        first, 30-40 each and 1.03x fcfs. Over three samples of each workload the median
        `aligned` / fcfs went from 0.93 to 0.96 (synthetic), 1.00 to 1.02 (Azure code),
        0.97 to 0.99 (ShareGPT4) offline."""
        windows = self.windows
        return sorted(self.pending, key=lambda i: (-windows[i].max_requests,
                                                   -windows[i].max_blocks, i))

    def _match(self, instance: int, now: float) -> Order | None:
        """Pool requests whose length lies in the instance's running window."""
        window = self.windows.get(instance)
        if window is None or not self.seqs:
            return None
        room = int(self.kv.free_blocks(f"staging{instance}") * MATCH_STAGING_SHARE)
        room = min(room, window.max_blocks)
        if room <= 0 or window.max_requests <= 0:
            return None
        ids = self.policy.matching(window.lo, window.hi, room, window.max_requests, now)
        if not ids:
            return None
        order = self._take(instance, -1, ids)
        taken = sum(self.kv.blocks_for(s.num_computed_tokens) for s in order.seqs)
        # this window's room is spent until the instance reports again
        self.windows[instance] = window._replace(max_blocks=window.max_blocks - taken,
                                                 max_requests=window.max_requests - len(ids))
        return order

    def _take(self, instance: int, batch_id: int, ids: list[str]) -> Order:
        seqs = [self.seqs[seq_id] for seq_id in ids]
        for seq in seqs:
            self._remove(seq)
            seq.instance, seq.batch_id = instance, batch_id
        return Order(instance, batch_id, seqs)

    def _remove(self, seq: Sequence) -> None:
        del self.seqs[seq.seq_id]
        self.policy.remove(seq.seq_id)

    def next_move(self, order: Order, now: float) -> Move | None:
        """The next prefetch (host -> staging) of `order`; None when it is all staged. A
        seq the staging buffer cannot take stays in the host pool and is copied straight to
        the decode device when admitted (also the `aligned-noprefetch` path)."""
        for seq in order.seqs[order.index:]:
            order.index += 1
            if self.policy.uses_staging and seq.seq_id not in self.life.finish_requests:
                move = self.life.reserve(seq, f"staging{order.instance}", at=now)
                if move is not None:
                    return move
        return None

    def landed(self, move: Move, now: float) -> None:
        move.seq.status = SeqStatus.STAGED
        self.life.event(move.seq.seq_id, "prefetched", now)
        self._landing(move).moved.append(move.seq)

    def deliver(self, order: Order, now: float) -> None:
        """Hands the staged order to its decode instance (aborted seqs end here)."""
        live = self.life.reap(order.seqs, now)
        if order.moved:
            self.wiring.pool_space()
        if live:  # with none left (aborted or failed while staged) it still `wants_batch`
            self.wiring.deliver(order.instance, order.batch_id, live)


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
        self.running: list[Sequence] = []
        self.cand_requests: list[Sequence] = []  # evicted or dynamically prefetched
        self.cand_batch: list[Sequence] = []
        self.cand_batch_id = self.current_batch_id = -1
        self.wants_batch = True  # a batch was asked for (the first: `Wiring.connect`)
        self.window: tuple[int, int] | None = None
        self._freed: set[str] = set()  # stores whose blocks this boundary's moves freed
        self._admissions: BoundaryPlan | None = None  # planned, not yet reserved
        self._forward_next = False  # the boundary is planned: the iteration comes next

    def receive(self, batch_id: int, seqs: list[Sequence]) -> None:
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
        if not self.cand_batch and not self.wants_batch:
            self.wants_batch = True
            self.wiring.to_batcher()

    def step(self, now: float) -> Forward | list[Move] | None:
        """The boundary's moves; once they landed, the admissions' moves; once those landed,
        the freed room is announced and the iteration follows. None while idle or waiting
        for a batch."""
        if (plan := self._admissions) is not None:
            self._admissions = None
            if plan.admit_batch:
                self.current_batch_id = self.cand_batch_id
            moves = self._admit(plan.admit_requests, self.cand_requests, now)
            moves += self._admit(plan.admit_batch, self.cand_batch, now)
            self.ask_for_batch()
            if moves:
                return moves
        if "host" in self._freed:
            self.wiring.pool_space()
        if self.staging in self._freed:
            self.wiring.to_batcher(BatcherCore.pool_changed)
        self._freed.clear()
        if self._forward_next:
            self._forward_next = False
            return self.forward(now) or None  # an eviction's moves: then a new boundary
        if not (self.running or self.cand_requests or self.cand_batch):
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
        moves += [m for i in plan.to_pool if (m := self._to_pool(by_id[i], now))]
        self._admissions = plan
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

    def _evict(self, seq: Sequence, now: float) -> list[Move]:
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

    def _to_pool(self, seq: Sequence, now: float) -> Move | None:
        """A running seq or a candidate request -> host pool, to be batched again. If the
        pool has no room it stays where it is."""
        never_staged = seq.location == "host"  # a candidate request: no copy
        move = None if never_staged else self.life.reserve(seq, "host", at=now)
        if move is None and not never_staged and not seq.is_finished:
            return None
        seq.num_returns += 1
        if seq in self.running:
            self.running.remove(seq)
            self.life.event(seq.seq_id, "evicted", now)
        else:
            self.cand_requests.remove(seq)
        if never_staged:
            self.wiring.to_batcher(lambda batcher: batcher.add(seq))
        return move

    def _admit(self, seq_ids: tuple[str, ...], buffer: list[Sequence],
               now: float) -> list[Move]:
        """Candidate buffer -> decode cache (from staging over the device link, or from
        the host pool for seqs that were never staged)."""
        by_id = {seq.seq_id: seq for seq in buffer}
        moves = []
        for seq_id in seq_ids:
            seq = by_id[seq_id]
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
            seq.status = SeqStatus.DECODING
        elif move.dst == self.staging:
            seq.status = SeqStatus.STAGED
            self.cand_requests.append(seq)
        else:
            self.wiring.to_batcher(lambda batcher: batcher.add(seq))

    def failed(self, move: Move, error: str, now: float) -> None:
        """A boundary copy failed: that seq alone ends with an error."""
        if move.seq in self.running:
            self.running.remove(move.seq)
        super().failed(move, error, now)

    # -- the iteration -------------------------------------------------------------------
    def forward(self, now: float) -> Forward | list[Move]:
        """The next iteration: every running seq whose KV can grow. If none can, evicts the
        longest running seq (moves to carry out, then a new boundary) or, with none
        running, returns [] (wait for the batcher)."""
        runnable = [s for s in self.running if self.kv.grow(s, s.num_tokens)]
        if not runnable:
            longest = max(self.running, key=lambda s: s.num_tokens, default=None)
            return self._evict(longest, now) if longest else []
        self._report_window(runnable)
        return Forward(self.name, runnable,
                       [s.num_tokens - s.num_computed_tokens for s in runnable], now)

    def _report_window(self, runnable: list[Sequence]) -> None:
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
            # NOTE: room net of what the candidate requests buffer already holds: matching
            # requests beyond what the batch can take would drain the pool into staging,
            # and the next batch would then be chosen from what little is left there.
            held = sum(self.kv.blocks_for(s.num_computed_tokens) for s in self.cand_requests)
            slots = self.sched.max_batch_size - len(self.running) - len(self.cand_requests)
            room = Window(*window, self.kv.free_blocks(self.name) - held, slots)
            self.wiring.to_batcher(lambda batcher: batcher.report_window(self.index, room))

    def fail(self, error: str, now: float) -> None:
        """The forward pass failed: the running batch ends with an error; the candidate
        buffers survive."""
        super().fail(error, now)
        self._forward_next, self._admissions = False, None


# -- colocated ------------------------------------------------------------------------
# ColocatedCore: the `continuous` baseline (vLLM / Orca): prefill and decode on one device,
# FCFS continuous batching with chunked prefill mixed into decode iterations under a token
# budget (ContinuousScheduler), preemption by recompute, no pool.


def _arrival_order(seq: Sequence) -> tuple[float, str]:
    return seq.request.arrival_time, seq.seq_id


class ColocatedCore(Core):
    """A waiting queue (arrival order), a running batch, one KV cache."""

    prefilled = SeqStatus.DECODING

    def __init__(self, ctx: Any, index: int) -> None:
        super().__init__(ctx, f"decode{index}", index)
        self.scheduler = ContinuousScheduler(self.sched.max_prefill_tokens,
                                             self.sched.max_batch_size, self.kv.block_size)
        self.waiting = SortedKeyList(key=_arrival_order)
        self.running: list[Sequence] = []

    def submit(self, seq: Sequence, front: bool = False) -> None:
        """A new request; `front` is accepted for symmetry (the queue is in arrival order)."""
        seq.status = SeqStatus.WAITING
        self.waiting.add(seq)

    def reap(self, now: float) -> None:
        """Ends the waiting seqs an abort asked to end (they hold no KV)."""
        if any(seq.seq_id in self.life.finish_requests for seq in self.waiting):
            self.waiting = SortedKeyList(self.life.reap(list(self.waiting), now),
                                         key=_arrival_order)

    def _view(self, seq: Sequence) -> ContinuousSeq:
        num_blocks = len(self.kv.table(seq)) if seq.location else 0
        return ContinuousSeq(seq.seq_id, seq.num_tokens, seq.num_computed_tokens, num_blocks,
                             seq.request.arrival_time)

    def step(self, now: float) -> Forward | None:
        """This step's work from the scheduler, with its KV blocks; None when nothing fits.

        NOTE: only the first max_batch_size waiting seqs (arrival order) are shown: the
        scheduler admits waiting seqs in that order and never more than a batch, so the
        plan is the one it would make over the whole queue, at a fraction of the cost.
        """
        self.running = self.life.reap(self.running, now)
        self.reap(now)
        head = list(self.waiting.islice(0, self.scheduler.max_batch_size))
        plan = self.scheduler.plan([self._view(s) for s in self.running],
                                   [self._view(s) for s in head], self.kv.free_blocks(self.name))
        by_id = {s.seq_id: s for s in (*self.running, *head)}
        for seq_id in plan.preempt:
            self._preempt(by_id[seq_id], now)
        seqs = [by_id[seq_id] for seq_id, _ in plan.scheduled]
        num_new_tokens = [num_new for _, num_new in plan.scheduled]
        for seq, num_new in zip(seqs, num_new_tokens):
            end = seq.num_computed_tokens + num_new
            ok = (self.kv.grow(seq, end) if seq.location
                  else self.kv.allocate(seq, self.name, end))
            assert ok, f"scheduler over-committed blocks for {seq.seq_id}"
            if seq.status == SeqStatus.WAITING:
                self.waiting.remove(seq)
                self.running.append(seq)
                seq.status = SeqStatus.PREFILLING
                self.life.event(seq.seq_id, "prefill_start", now)
        return Forward(self.name, seqs, num_new_tokens, now) if seqs else None

    def _preempt(self, seq: Sequence, now: float) -> None:
        """Frees a running seq's KV and queues it again for recompute."""
        self.running.remove(seq)
        self.kv.release(seq)
        seq.num_computed_tokens = 0
        self.life.event(seq.seq_id, "evicted", now)
        self.submit(seq)

    def landed(self, move: Move, now: float) -> None:
        """A sample's copy of its prompt's KV landed: it runs from its last prompt token."""
        self.running.append(move.seq)
