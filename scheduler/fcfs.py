"""DistServe-like baseline: the disaggregated pipeline with first-come-first-served choices
everywhere (pool order, eviction of the latest arrival, strict in-order admission).
"""

from __future__ import annotations

from sortedcontainers import SortedList

from scheduler.batching import (
    BoundaryPlan,
    BoundaryView,
    SeqView,
    by_arrival,
    plan_boundary_with,
    take_in_order,
)
from scheduler.policy import Policy, PolicyConfig, register_policy


@register_policy
class FcfsPolicy(Policy):
    """Pool in arrival order; no length awareness anywhere."""

    name = "fcfs"

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__(config)
        self._order = SortedList()  # (arrival_time, seq_id)
        self._seqs: dict[str, SeqView] = {}

    def add(self, seq: SeqView) -> None:
        if seq.seq_id in self._seqs:
            raise ValueError(f"seq_id {seq.seq_id!r} is already in the pool")
        self._seqs[seq.seq_id] = seq
        self._order.add((seq.arrival_time, seq.seq_id))

    def remove(self, seq_id: str) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise KeyError(f"seq_id {seq_id!r} is not in the pool")
        self._order.remove((seq.arrival_time, seq_id))

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def next_batch(self, max_blocks: int, max_requests: int, now: float) -> list[str]:
        """Oldest first while blocks fit; the first that does not fit ends the batch."""
        candidates = ((seq_id, self._seqs[seq_id].num_blocks) for _, seq_id in self._order)
        return take_in_order(candidates, max_blocks, max_requests)

    def plan_boundary(self, view: BoundaryView) -> BoundaryPlan:
        """Evict the latest arrivals when short of room; else admit strictly by arrival."""
        return plan_boundary_with(view, lambda: by_arrival(view.running)[::-1],
                                  by_arrival(view.candidate_requests),
                                  by_arrival(view.candidate_batch), is_strict=True)
