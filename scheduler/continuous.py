"""vLLM-v1-style continuous batching with chunked prefill, for the `continuous` baseline.

Prefill and decode share one device and there is no host pool: every step schedules
running seqs first, then waiting ones FCFS, under a token budget and the free KV blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.batching import BoundaryPlan, BoundaryView, SeqView, ceil_div
from scheduler.policy import Policy, register_policy


@dataclass(frozen=True, slots=True)
class ContinuousSeq:
    """What the continuous scheduler may know about a sequence."""

    seq_id: str
    num_tokens: int  # prompt + generated tokens so far
    num_computed_tokens: int  # tokens whose KV exists; the work left is the difference
    num_blocks: int  # KV blocks the seq holds now
    arrival_time: float  # seconds, caller's clock


@dataclass(frozen=True, slots=True)
class ContinuousPlan:
    """One step: preempt first (the engine frees their blocks), then run ``scheduled``."""

    preempt: tuple[str, ...] = ()  # running seqs to preempt (recomputed later)
    scheduled: tuple[tuple[str, int], ...] = ()  # (seq_id, num_new_tokens), running first


class ContinuousScheduler:
    """Plans one step; never over-commits the token budget, the batch size or free blocks."""

    def __init__(self, max_num_tokens: int, max_batch_size: int, block_size: int) -> None:
        for name, value in (("max_num_tokens", max_num_tokens),
                            ("max_batch_size", max_batch_size), ("block_size", block_size)):
            if value < 1:
                raise ValueError(f"{name} ({value}) must be >= 1")
        self.max_num_tokens = max_num_tokens
        self.max_batch_size = max_batch_size
        self.block_size = block_size

    def blocks_for(self, seq: ContinuousSeq, num_new_tokens: int) -> int:
        """Blocks ``seq`` must gain to compute ``num_new_tokens`` more tokens."""
        num_needed = ceil_div(seq.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, num_needed - seq.num_blocks)

    def plan(self, running: Sequence[ContinuousSeq], waiting: Sequence[ContinuousSeq],
             free_blocks: int) -> ContinuousPlan:
        """Running seqs oldest first, then waiting seqs oldest first.

        A running seq gets all its remaining tokens (1 in decode) capped by the budget left;
        when blocks run out the most recently arrived running seq is preempted, possibly
        the one being scheduled. Waiting seqs are admitted only in a step that preempted
        nothing, each with a chunk under the budget left; the first whose blocks do not
        fit stops admission (FCFS).
        """
        queue = sorted(running, key=lambda s: (s.arrival_time, s.seq_id))
        scheduled: list[tuple[str, int]] = []
        preempted: list[str] = []
        budget = self.max_num_tokens
        index = 0
        while index < len(queue) and budget > 0 and len(scheduled) < self.max_batch_size:
            seq = queue[index]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            need = self.blocks_for(seq, num_new) if num_new > 0 else 0
            while need > free_blocks and len(queue) > index + 1:
                victim = queue.pop()
                preempted.append(victim.seq_id)
                free_blocks += victim.num_blocks
            if need > free_blocks:
                preempted.append(queue.pop(index).seq_id)
                break
            if num_new > 0:
                scheduled.append((seq.seq_id, num_new))
                budget -= num_new
                free_blocks -= need
            index += 1
        if not preempted:
            self._admit_waiting(waiting, scheduled, budget, free_blocks)
        return ContinuousPlan(preempt=tuple(preempted), scheduled=tuple(scheduled))

    def _admit_waiting(self, waiting: Sequence[ContinuousSeq], scheduled: list[tuple[str, int]],
                       budget: int, free_blocks: int) -> None:
        for seq in sorted(waiting, key=lambda s: (s.arrival_time, s.seq_id)):
            if budget <= 0 or len(scheduled) >= self.max_batch_size:
                return
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            need = self.blocks_for(seq, num_new)
            if num_new <= 0 or need > free_blocks:
                return
            scheduled.append((seq.seq_id, num_new))
            budget -= num_new
            free_blocks -= need


@register_policy
class ContinuousPolicy(Policy):
    """vLLM/Orca-like baseline; scheduled by ``ContinuousScheduler``, not by this object."""

    name = "continuous"
    uses_pool = False
    uses_staging = False

    def add(self, seq: SeqView) -> None:
        raise ValueError(f"policy {self.name!r} has no host pool (uses_pool is False); "
                         f"cannot add seq {seq.seq_id!r}")

    def remove(self, seq_id: str) -> None:
        raise KeyError(f"seq_id {seq_id!r} is not in the pool (policy {self.name!r} has none)")

    def __len__(self) -> int:
        return 0

    def __contains__(self, seq_id: object) -> bool:
        return False

    def next_batch(self, max_blocks: int, max_requests: int, now: float) -> list[str]:
        return []

    def plan_boundary(self, view: BoundaryView) -> BoundaryPlan:
        return BoundaryPlan()
