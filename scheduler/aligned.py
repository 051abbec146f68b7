"""The paper's policy: quad-tree pool, density-first search with starvation control,
dynamic prefetch, and batch-level scheduling at iteration boundaries (DESIGN §1, §4).
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.batching import (
    BoundaryPlan,
    BoundaryView,
    SeqView,
    by_arrival,
    by_distance,
    by_length_desc,
    median_length,
    plan_boundary_with,
    take_in_order,
)
from scheduler.dfs import anchored_search, density_first_search
from scheduler.policy import Policy, PolicyConfig, register_policy
from scheduler.quadtree import QuadTree


@register_policy
class AlignedPolicy(Policy):
    """Prefix-aware batching: batches of similar length, refilled by length at boundaries."""

    name = "aligned"
    uses_dynamic_prefetch = True

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__(config)
        self.tree = QuadTree(config.max_len, config.leaf_width)

    def add(self, seq: SeqView) -> None:
        self.tree.insert(seq.seq_id, seq.length, seq.num_blocks, seq.arrival_time)

    def remove(self, seq_id: str) -> None:
        self.tree.remove(seq_id)

    def __len__(self) -> int:
        return len(self.tree)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self.tree

    def starving_request(self, now: float) -> str | None:
        """The oldest pooled request if it has waited longer than the threshold at ``now``."""
        threshold = self.config.starvation_threshold
        if threshold is None or now - self.tree.oldest_arrival <= threshold:
            return None
        return self.tree.oldest_request_id()

    def is_starving(self, view: BoundaryView, seqs: Sequence[SeqView]) -> bool:
        """Whether one of `seqs` has waited longer than the threshold at the boundary."""
        threshold = self.config.starvation_threshold
        if threshold is None or view.now is None:
            return False
        return any(view.now - s.arrival_time > threshold for s in seqs)

    def next_batch(self, max_blocks: int, max_requests: int, now: float) -> list[str]:
        """DFS, except that a starving request is served first, with the subtree around it.

        NOTE: the anchored search puts the starving request in this very batch, so a long
        request overtaken by streams of short ones waits at most threshold + one batch. If
        it does not fit ``max_blocks`` on its own, plain DFS runs so the pool keeps moving.
        """
        min_requests = min(self.config.min_requests, max_requests)
        starving_id = self.starving_request(now)
        if starving_id is not None:
            batch = anchored_search(self.tree, starving_id, max_blocks, min_requests,
                                    max_requests)
            if batch:
                return batch
        return density_first_search(self.tree, max_blocks, min_requests, max_requests)

    def matching(self, lo: int, hi: int, max_blocks: int, max_requests: int,
                 now: float | None = None) -> list[str]:
        """Pooled requests with ``lo <= length <= hi``, shortest first, while they fit.

        NOTE: none while a pooled request starves: matching requests would keep the running
        batch fed, the candidate batch would never drain, and the next batch (which serves
        the starving request) would never be formed.
        """
        if now is not None and self.starving_request(now) is not None:
            return []
        candidates = ((seq_id, blocks) for _, seq_id, blocks in self.tree.requests_in_range(lo, hi))
        return take_in_order(candidates, max_blocks, max_requests)

    def plan_boundary(self, view: BoundaryView) -> BoundaryPlan:
        """The paper's batch-level scheduling (finished seqs are already gone from the view).

        - Short of room: evict the longest seq of the old batch (running seqs whose
          batch_id differs from current_batch_id) while there is one, else the longest,
          until the next step fits.
        - Otherwise admit candidate requests closest in length to the current batch first
          (they join without widening its length spread, which is the whole point), then
          candidate-batch seqs oldest first (a batch switch; seqs that do not fit yet wait
          for the old batch to drain, and oldest-first keeps that wait fair).
        """
        current = [s for s in view.running if s.batch_id == view.current_batch_id]
        old = [s for s in view.running if s.batch_id != view.current_batch_id]
        victims = by_length_desc(old) + by_length_desc(current)
        reference = next((m for m in (median_length(current), median_length(view.running),
                                      median_length(view.candidate_batch)) if m is not None),
                         None)
        requests = (by_arrival(view.candidate_requests) if reference is None
                    else by_distance(view.candidate_requests, reference))
        # NOTE: starvation at the boundary. An evicted long request can wait in the candidate
        # requests buffer behind closer-length ones forever, and candidate requests matching
        # the running batch can keep it fed while a starving request waits in the candidate
        # batch; smaller neighbours would keep taking the room it needs. So a buffer holding a
        # starving request goes first, strictly in arrival order.
        if self.is_starving(view, view.candidate_requests):
            return plan_boundary_with(view, victims, by_arrival(view.candidate_requests), [],
                                      is_strict=True)
        if self.is_starving(view, view.candidate_batch):
            return plan_boundary_with(view, victims, [], by_arrival(view.candidate_batch),
                                      is_strict=True)
        return plan_boundary_with(view, victims, requests, by_arrival(view.candidate_batch),
                                  is_strict=False)


@register_policy
class AlignedNoPrefetchPolicy(AlignedPolicy):
    """Ablation: the same decisions, but KV goes host -> decode directly, no prefetch."""

    name = "aligned-noprefetch"
    uses_staging = False
    uses_dynamic_prefetch = False

    def matching(self, lo: int, hi: int, max_blocks: int, max_requests: int,
                 now: float | None = None) -> list[str]:
        return []
