"""The state machine of a prefill instance."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from aserve.cores.base import Core, Forward, Move, Pooled
from aserve.engine.sequence import SeqState, SeqStatus
from scheduler.policy import PREFILL_PASSES

# -- prefill --------------------------------------------------------------------------
# PrefillCore: one prefill instance. Packs waiting prompts under a token budget into one
# forward pass; each prefilled request's KV then goes to the host pool, in order, while the
# pool has room (backpressure: no prefill starts while an offload waits for room). In
# arrival order, or shortest first where the policy asks (`Policy.prefills_shortest_first`)
# and the device also decodes; there the policy also says how many of the waiting prompts
# may go now, holding back those that would not start decoding soon (`Policy.prefill_quota`).


@dataclass(slots=True)
class Place:
    """A waiting seq's place in a shortest-first line (``PrefillCore._shortest_first``)."""

    mark: int  # its submission's number
    passed: int | None = None  # the submissions' count when a prefill first passed it over
    overtaken: int = 0  # prefills since then that took a seq submitted after that


class PrefillCore(Core):
    """A waiting queue, a scratch KV store, and the prefilled seqs waiting for the pool."""

    def __init__(self, ctx: Any, index: int) -> None:
        super().__init__(ctx, f"prefill{index}", index)
        self.waiting: deque[SeqState] = deque()
        self.blocked: deque[SeqState] = deque()  # prefilled; waiting for host-pool room
        self.prefilling: list[SeqState] = []  # the forward in flight
        config = ctx.config
        self.shares_device = config.prefill_devices[index] in config.decode_devices
        # each waiting seq's place in line, by id (shortest first)
        self.places: dict[str, Place] = {}
        self.num_submitted = 0

    def submit(self, seq: SeqState, front: bool = False) -> None:
        """A new (or recompute-evicted) request; `front` puts it first in line."""
        self.life.transition(seq, SeqStatus.WAITING)
        (self.waiting.appendleft if front else self.waiting.append)(seq)
        if self.shares_device:
            self.num_submitted += 1
            self.places[seq.seq_id] = Place(self.num_submitted,
                                            overtaken=PREFILL_PASSES if front else 0)

    def reap(self, now: float) -> None:
        """Ends the waiting seqs an abort asked to end (they hold no KV)."""
        num = len(self.waiting)
        self.waiting = deque(self.life.reap(list(self.waiting), now))
        if len(self.waiting) < num:
            self.places = {s.seq_id: self.places[s.seq_id] for s in self.waiting
                           if s.seq_id in self.places}
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
        self.reap(now)
        quota = self.quota() if self.waiting else 0
        return self.forward(now, quota) if quota else None

    def held(self) -> bool:
        """Whether the policy holds the next prefill back (`Policy.prefill_quota`), where
        the device also decodes; the wiring wakes this instance when that may change."""
        return bool(self.waiting) and self.quota() == 0

    def quota(self) -> int:
        """How many waiting prompts, in line, the next prefill may take
        (`Policy.prefill_quota` where the device also decodes and prefill goes shortest
        first; else all). Asked at every decode boundary: the lines are built only there."""
        if not (self.shares_device and self.waiting and self.policy.prefills_shortest_first()):
            return len(self.waiting)
        self._shortest_first()
        running = [s.num_tokens for d in self.wiring.decodes for s in d.core.running]
        # each prompt as it would be pooled: with its first token
        waiting = [(s.num_tokens + 1, self.kv.blocks_for(s.num_tokens + 1),
                    s.request.arrival_time) for s in self.waiting]
        return self.policy.prefill_quota(len(self.life.unstarted), running, waiting)

    def forward(self, now: float, quota: int) -> Forward | None:
        """The next packed prefill: up to ``quota`` waiting seqs (reaped and put in line
        by ``quota()``, asked once per prefill), in line, up to the token budget, whose
        KV fits."""
        shortest_first = self.shares_device and self.policy.prefills_shortest_first()
        budget = self.sched.max_prefill_tokens
        latest = 0  # the latest submission prefilled
        batch: list[SeqState] = []
        while self.waiting and len(batch) < quota:
            seq = self.waiting[0]
            if batch and seq.num_tokens > budget:
                break
            if not self.kv.allocate(seq, self.name, seq.num_tokens):
                # NOTE: forward runs on an empty store (step offloads the last batch first),
                # and admission control (BlockLedger.check_fits) sizes every seq to fit it
                assert batch, f"{seq.seq_id} does not fit the empty {self.name} store"
                break
            batch.append(self.waiting.popleft())
            place = self.places.pop(seq.seq_id, None)
            latest = max(latest, place.mark if place is not None else 0)
            budget -= seq.num_tokens
        if not batch:
            return None
        if shortest_first:
            self._count_overtakes(latest)
        self.prefilling = batch
        for seq in batch:
            self.life.transition(seq, SeqStatus.PREFILLING)
            self.life.event(seq.seq_id, "prefill_start", now)
        return Forward(self.name, batch, [seq.num_tokens for seq in batch], now)

    def _shortest_first(self) -> None:
        """Puts the waiting seqs in line: those overtaken in ``PREFILL_PASSES`` prefills
        first, in line as they were, then the rest shortest first (ties in line order).
        Forgets the seqs that left the line otherwise (reaped, or moved by a driver)."""
        self.places = {s.seq_id: self.places[s.seq_id] for s in self.waiting}
        due = [s for s in self.waiting if self.places[s.seq_id].overtaken >= PREFILL_PASSES]
        rest = sorted((s for s in self.waiting
                       if self.places[s.seq_id].overtaken < PREFILL_PASSES),
                      key=lambda s: s.num_tokens)
        self.waiting = deque(due + rest)

    def _count_overtakes(self, latest: int) -> None:
        """A prefill left the line, ``latest`` the number of its latest submission: every
        waiting seq that an earlier prefill passed over already, and that a seq submitted
        since then overtook, was overtaken once more.

        NOTE: a backlog submitted at once (offline) has distinct arrival stamps, in the
        order it was submitted; counted by arrival alone, every prompt of it was overtaken
        by later ones in its first prefills, and it went on in arrival order. Its prompts
        were all in line at the first prefill that passed them over, so none overtakes
        another: it drains shortest first, while under a stream a prompt passed over still
        goes first once later arrivals took ``PREFILL_PASSES`` prefills before it."""
        for seq in self.waiting:
            place = self.places[seq.seq_id]
            if place.passed is None:
                place.passed = self.num_submitted
            elif latest > place.passed:
                place.overtaken += 1

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


