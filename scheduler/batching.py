"""Batch-level scheduling at a decode iteration boundary: views, plans and the shared rules.

Policies choose an eviction order and an admission order; the block arithmetic and the
anti-thrash rule live here once. Pure: no clock, no I/O, no torch.
"""

from __future__ import annotations

import operator
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

BY_ID, BY_ARRIVAL = operator.attrgetter("seq_id"), operator.attrgetter("arrival_time")
ADMIT_LOOKAHEAD = 1  # extra tokens of growth an admission reserves beyond the next step
# NOTE: liveness. A batch switch that returns the old batch's stragglers to the pool could
# return them again when they come back as the next batch, and two small groups of unlike
# lengths would trade places forever, a KV round trip per token (a livelock). So
# a policy returns a seq to the pool at most this many times; then it stays until done.
MAX_RETURNS = 2


@dataclass(frozen=True, slots=True)
class SeqView:
    """What a policy may know about a sequence."""

    seq_id: str
    length: int  # tokens whose KV exists after the next decode step (= num_tokens)
    num_blocks: int  # blocks its KV holds now
    arrival_time: float  # seconds, caller's clock
    batch_id: int = -1  # candidate batch it was admitted with (-1: a single request)
    waiting_since: float | None = None  # its last progress, e.g. last token (None: arrival)
    num_returns: int = 0  # times a policy has sent it back to the host pool mid-decode
    num_output_tokens: int = 0  # tokens it has generated so far (the first, from prefill, too)

    @property
    def wait_start(self) -> float:
        """Since when it has waited without progress (starvation control's clock)."""
        return self.arrival_time if self.waiting_since is None else self.waiting_since


@dataclass(frozen=True, slots=True)
class BoundaryView:
    """One decode instance at an iteration boundary (finished seqs already released)."""

    running: tuple[SeqView, ...]
    free_blocks: int  # decode KV blocks free now
    block_size: int  # tokens per block
    max_batch_size: int  # most seqs one iteration may run
    candidate_requests: tuple[SeqView, ...]  # staged single requests (evicted / prefetched)
    candidate_batch: tuple[SeqView, ...]  # the staged next batch (may be empty)
    current_batch_id: int  # running seqs with another batch_id belong to the old batch
    now: float  # the driver's clock at this boundary (seconds; the clock of arrival_time)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size ({self.block_size}) must be >= 1")
        if self.free_blocks < 0:
            raise ValueError(f"free_blocks ({self.free_blocks}) must be >= 0")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size ({self.max_batch_size}) must be >= 1")


@dataclass(frozen=True, slots=True)
class BoundaryPlan:
    """What to move at this boundary; the engine applies evictions, then returns to the
    pool, then admissions."""

    evict: tuple[str, ...] = ()  # running -> candidate requests buffer (or pool if full)
    admit_requests: tuple[str, ...] = ()  # candidate requests buffer -> running
    admit_batch: tuple[str, ...] = ()  # candidate batch -> running
    to_pool: tuple[str, ...] = ()  # running or candidate requests -> host pool, to be re-batched


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints (b > 0), e.g. the blocks that hold ``a`` tokens."""
    return -(-a // b)


def tree_range(num_tokens: int) -> int:
    """The smallest power of 4 (>= 4) covering ``num_tokens``: a quad-tree's length range."""
    size = 4
    while size < num_tokens:
        size *= 4
    return size


def blocks_needed(seq: SeqView, block_size: int, num_lookahead: int = 0) -> int:
    """Blocks a running seq must gain for the next step (+ ``num_lookahead`` more tokens)."""
    return max(0, ceil_div(seq.length + num_lookahead, block_size) - seq.num_blocks)


def blocks_to_admit(seq: SeqView, block_size: int, num_lookahead: int = 0) -> int:
    """Decode blocks a staged seq occupies once admitted, growth for the next step included."""
    return max(seq.num_blocks, ceil_div(seq.length + num_lookahead, block_size))


def take_in_order(candidates: Iterable[tuple[str, int]], max_blocks: int,
                  max_requests: int) -> list[str]:
    """Ids of ``(seq_id, num_blocks)`` candidates, in order, while they fit both limits.

    The first candidate that does not fit ends the selection (no overtaking).
    """
    chosen: list[str] = []
    for seq_id, num_blocks in candidates:
        if len(chosen) >= max_requests or num_blocks > max_blocks:
            break
        chosen.append(seq_id)
        max_blocks -= num_blocks
    return chosen


def by_length_desc(seqs: Iterable[SeqView]) -> list[SeqView]:
    """Longest first; among equal lengths the latest arrival first, then by id."""
    return sorted(seqs, key=lambda s: (-s.length, -s.arrival_time, s.seq_id))


def by_arrival(seqs: Iterable[SeqView]) -> list[SeqView]:
    """Oldest first, then by id. NOTE: two stable sorts on one key each, by id then by
    arrival: the same order as one sort on (arrival, id), and faster over a large candidate
    batch whose arrivals tie (it is sorted at every boundary it waits)."""
    return sorted(sorted(seqs, key=BY_ID), key=BY_ARRIVAL)


def by_distance(seqs: Iterable[SeqView], reference: float) -> list[SeqView]:
    """Closest length to ``reference`` first; ties: oldest first."""
    return sorted(seqs, key=lambda s: (abs(s.length - reference), s.arrival_time, s.seq_id))


@dataclass(slots=True)
class LengthRange:
    """The shortest and longest length of a group, grown one length at a time."""

    lo: int = 0
    hi: int = -1  # hi < lo: empty

    @classmethod
    def of(cls, lengths: Iterable[int]) -> LengthRange:
        lengths = list(lengths)
        return cls(min(lengths), max(lengths)) if lengths else cls()

    def fits(self, length: int, max_spread: float) -> bool:
        """Whether ``length`` joins with the longest at most ``max_spread`` times the
        shortest (always true for an empty group)."""
        if self.hi < self.lo:
            return True
        return max(self.hi, length) <= max_spread * min(self.lo, length)

    def add(self, length: int) -> None:
        self.lo, self.hi = ((length, length) if self.hi < self.lo
                            else (min(self.lo, length), max(self.hi, length)))


def median_length(seqs: Sequence[SeqView]) -> float | None:
    """``statistics.median`` of the lengths, from a list (it runs over the running seqs at
    every refill; a generator costs twice as much)."""
    return statistics.median([s.length for s in seqs]) if seqs else None


def growth(seqs: Iterable[SeqView], block_size: int, num_lookahead: int = 0) -> int:
    """``blocks_needed`` summed over ``seqs`` (one pass, inlined: it runs over every running
    seq at every boundary, the largest part of a decision's time at 256 slots)."""
    offset = num_lookahead + block_size - 1
    return sum(need for s in seqs if (need := (s.length + offset) // block_size - s.num_blocks) > 0)


def oldest_wait(seqs: Iterable[SeqView]) -> float:
    """The earliest ``wait_start`` of non-empty ``seqs`` (inlined: it runs over the candidate
    batch at every boundary)."""
    return min([s.arrival_time if s.waiting_since is None else s.waiting_since for s in seqs])


def plan_evictions(view: BoundaryView,
                   victims: Callable[[], Iterable[SeqView]]) -> tuple[str, ...]:
    """Evict from ``victims()`` (in order) until the next step's growth fits
    ``free_blocks``. The order is built only when some seq must go.

    Evicting a seq frees the blocks it holds and drops its growth. Returns () when the
    step already fits.
    """
    shortfall = growth(view.running, view.block_size) - view.free_blocks
    if shortfall <= 0:
        return ()
    evicted: list[str] = []
    for seq in victims():
        if shortfall <= 0:
            break
        evicted.append(seq.seq_id)
        shortfall -= seq.num_blocks + blocks_needed(seq, view.block_size)
    return tuple(evicted)


def admission_room(view: BoundaryView, reserve: int | None = None) -> tuple[int, int]:
    """(blocks, slots) free for admissions once the running seqs' growth is reserved.

    The reserve covers the next step and the one after (ADMIT_LOOKAHEAD), see
    ``plan_boundary_with``; ``reserve``: that growth if the caller has it already.
    """
    if reserve is None:
        reserve = growth(view.running, view.block_size, ADMIT_LOOKAHEAD)
    return view.free_blocks - reserve, view.max_batch_size - len(view.running)


def plan_admissions(view: BoundaryView, requests: Sequence[SeqView], batch: Sequence[SeqView],
                    is_strict: bool, max_spread: float | None = None,
                    accepts: Callable[[list[int], SeqView], bool] | None = None,
                    reserve: int | None = None,
                    lengths: Sequence[int] | None = None) -> BoundaryPlan:
    """Admit candidate requests, then the candidate batch, in the given orders.

    A seq is admitted only if it fits the remaining blocks with its growth (for the next
    step and the one after) and a batch slot is free. ``is_strict`` (FCFS): the first seq
    that does not fit stops all admission; otherwise it is skipped and smaller ones behind
    it may still enter. ``max_spread``: a seq is also skipped if it would leave the running
    seqs plus those admitted so far with the longest above ``max_spread`` times the
    shortest (a candidate batch wider than that enters in pieces, as the batch drains).
    ``accepts(lengths, seq)``: a candidate request (not a candidate batch seq) is also
    skipped unless it accepts joining seqs of ``lengths`` (the running ones and those
    admitted so far). ``reserve``: the running seqs' growth, see ``admission_room``;
    ``lengths``: the running seqs' lengths, where the caller has them (not changed).
    """
    blocks_left, slots_left = admission_room(view, reserve)
    spread = None if max_spread is None else LengthRange.of(s.length for s in view.running)
    lengths = [s.length for s in view.running] if lengths is None else list(lengths)
    admitted: tuple[list[str], list[str]] = ([], [])
    block_size, offset = view.block_size, ADMIT_LOOKAHEAD + view.block_size - 1
    for chosen, seqs in zip(admitted, (requests, batch)):
        for seq in seqs:
            if slots_left <= 0:
                break
            if (spread is not None and max_spread is not None
                    and not spread.fits(seq.length, max_spread)):
                continue
            # blocks_to_admit, inlined: this loop may pass over a whole candidate batch
            cost = max(seq.num_blocks, (seq.length + offset) // block_size)
            if cost > blocks_left:
                if is_strict:
                    slots_left = 0
                    break
                continue
            if accepts is not None and chosen is admitted[0] and not accepts(lengths, seq):
                continue
            chosen.append(seq.seq_id)
            lengths.append(seq.length)
            if spread is not None:
                spread.add(seq.length)
            blocks_left -= cost
            slots_left -= 1
    return BoundaryPlan(admit_requests=tuple(admitted[0]), admit_batch=tuple(admitted[1]))


def plan_boundary_with(view: BoundaryView, victims: Callable[[], Iterable[SeqView]],
                       requests: Sequence[SeqView], batch: Sequence[SeqView],
                       is_strict: bool) -> BoundaryPlan:
    """Evict if the step lacks room, otherwise admit: never both at one boundary.

    NOTE: this is the anti-thrash rule. (1) A boundary that evicts admits nothing, so a
    victim cannot re-enter in the same boundary. (2) Admissions reserve the growth of the
    next two steps for every running and admitted seq, so the boundary right after an
    admission never has to evict: a seq is not admitted only to be pushed out again.
    """
    evict = plan_evictions(view, victims)
    if evict:
        return BoundaryPlan(evict=evict)
    return plan_admissions(view, requests, batch, is_strict)
