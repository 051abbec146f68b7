"""The paper's policy: quad-tree pool, density-first search with starvation control,
dynamic prefetch, and batch-level scheduling at iteration boundaries (docs/design.md §1, §4),
as two fixed rules: `aligned-strict` (every batch within ``max_spread``) and `aligned-loose`
(the paper's rules as written). The cost-aware default, `aligned`, is scheduler/aligned.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import msgspec

from scheduler.batching import (
    MAX_RETURNS,
    BoundaryPlan,
    BoundaryView,
    LengthRange,
    SeqView,
    by_arrival,
    by_distance,
    by_length_desc,
    median_length,
    oldest_wait,
    plan_admissions,
    plan_boundary_with,
    plan_evictions,
    take_in_order,
)
from scheduler.dfs import anchored_search, density_first_search
from scheduler.policy import Policy, PolicyConfig, register_policy
from scheduler.quadtree import QuadTree


@register_policy
class AlignedStrictPolicy(Policy):
    """Prefix-aware batching: batches of similar length, refilled by length at boundaries,
    every running batch within ``max_spread`` (1.5 by default)."""

    name = "aligned-strict"
    uses_dynamic_prefetch = True

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__(config)
        self.tree = QuadTree(config.max_len, config.leaf_width)

    def add(self, seq: SeqView) -> None:
        # NOTE: starvation counts from a request's last progress (its last token), not from
        # its arrival: one returned to the pool mid-decode has been served, and by arrival
        # time it would count as starving at once, overtaking fresh requests that have
        # waited longer than it without a token.
        self.tree.insert(seq.seq_id, seq.length, seq.num_blocks, seq.wait_start)

    def remove(self, seq_id: str) -> None:
        self.tree.remove(seq_id)

    def __len__(self) -> int:
        return len(self.tree)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self.tree

    def starving_request(self, now: float) -> str | None:
        """The oldest pooled request if it has waited longer than the threshold at ``now``."""
        threshold = self.config.starvation_threshold
        if threshold is None or self.starvation_clock(now) - self.tree.oldest_arrival <= threshold:
            return None
        return self.tree.oldest_request_id()

    def starvation_clock(self, now: float) -> float:
        """The time starvation is measured at, at ``now``: ``now`` (see ``aligned``'s)."""
        return now

    def is_starving(self, view: BoundaryView, seqs: Sequence[SeqView]) -> bool:
        """Whether one of `seqs` has waited longer than the threshold at the boundary."""
        return bool(seqs) and self._past_threshold(view, oldest_wait(seqs))

    def is_overdue(self, view: BoundaryView, seq: SeqView) -> bool:
        """Whether ``seq`` arrived longer than the starvation threshold ago: it is never
        sent back to the pool, so a request served by starvation control keeps its place
        (otherwise the next switch would return it, and it would starve again)."""
        return self._past_threshold(view, seq.arrival_time)

    def may_return(self, view: BoundaryView, seq: SeqView) -> bool:
        """Whether a batch switch may send running ``seq`` back to the pool: not overdue,
        and returned fewer than ``MAX_RETURNS`` times (scheduler/batching.py: liveness)."""
        return seq.num_returns < MAX_RETURNS and not self.is_overdue(view, seq)

    def _past_threshold(self, view: BoundaryView, since: float) -> bool:
        """Whether more than the starvation threshold has passed since ``since`` at the
        boundary (never without a threshold)."""
        threshold = self.config.starvation_threshold
        return threshold is not None and self.starvation_clock(view.now) - since > threshold

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
        return self.search(max_blocks, min_requests, max_requests)

    def search(self, max_blocks: int, min_requests: int, max_requests: int) -> list[str]:
        """The next batch when no request starves: DFS."""
        return density_first_search(self.tree, max_blocks, min_requests, max_requests)

    def matching(self, lo: int, hi: int, max_blocks: int, max_requests: int,
                 now: float) -> list[str]:
        """Pooled requests with ``lo <= length <= hi``, shortest first, while they fit.

        NOTE: none while a pooled request starves: matching requests would keep the running
        batch fed, the candidate batch would never drain, and the next batch (which serves
        the starving request) would never be formed.
        """
        if self.starving_request(now) is not None:
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

        With ``max_spread`` (`aligned-strict`; see ``_plan_strict``) no refill or switch may leave
        the running batch wider than that; ``aligned-loose`` keeps the rules above as is.
        """
        current = [s for s in view.running if s.batch_id == view.current_batch_id]
        old = [s for s in view.running if s.batch_id != view.current_batch_id]

        def victims() -> list[SeqView]:
            return by_length_desc(old) + by_length_desc(current)
        # NOTE: starvation at the boundary. An evicted long request can wait in the candidate
        # requests buffer behind closer-length ones forever, and candidate requests matching
        # the running batch can keep it fed while a starving request waits in the candidate
        # batch; smaller neighbours would keep taking the room it needs. So a buffer holding a
        # starving request goes first, strictly in arrival order, alignment aside.
        if self.is_starving(view, view.candidate_requests):
            return plan_boundary_with(view, victims, by_arrival(view.candidate_requests), [],
                                      is_strict=True)
        if self.is_starving(view, view.candidate_batch):
            return plan_boundary_with(view, victims, [], by_arrival(view.candidate_batch),
                                      is_strict=True)
        if self.config.max_spread is None:
            return plan_boundary_with(view, victims, self._closest_first(view, current),
                                      by_arrival(view.candidate_batch), is_strict=False)
        return self._plan_strict(view, current, old, victims)

    @staticmethod
    def _closest_first(view: BoundaryView, current: Sequence[SeqView]) -> list[SeqView]:
        """Candidate requests closest in length to the current batch (else the running
        seqs, else the candidate batch) first; in arrival order when all are empty."""
        if not view.candidate_requests:
            return []
        reference = next((m for m in (median_length(current), median_length(view.running),
                                      median_length(view.candidate_batch)) if m is not None),
                         None)
        if reference is None:
            return by_arrival(view.candidate_requests)
        return by_distance(view.candidate_requests, reference)

    def _plan_strict(self, view: BoundaryView, current: Sequence[SeqView],
                     old: Sequence[SeqView],
                     victims: Callable[[], Sequence[SeqView]]) -> BoundaryPlan:
        """Strict alignment (`aligned-strict`, ``max_spread``). Every admission, candidate request
        or candidate batch seq, keeps the running seqs within ``max_spread``; seqs only grow,
        so a batch admitted within it stays within it. A switch to a candidate batch that
        does not fit waits for the old batch to drain, down to ``drain_floor`` of the batch
        slots; then the few left go back to the host pool (``_switch``). Old-batch victims go
        back to the pool too (they match neither batch). Requests that arrived longer than
        the starvation threshold ago are never sent back.

        NOTE: the drain costs batch occupancy, the returns cost KV copies (two, out and back
        in). On tests/cores/test_alignment.py's pool this keeps every iteration within the
        bound, but it costs decode throughput against fcfs wherever misalignment is cheap.
        """
        evict = plan_evictions(view, victims)
        if evict:
            returned = {s.seq_id for s in old if self.may_return(view, s)}
            return BoundaryPlan(evict=tuple(i for i in evict if i not in returned),
                                to_pool=tuple(i for i in evict if i in returned))
        spread = self.config.max_spread
        requests = self._closest_first(view, current)
        batch = by_arrival(view.candidate_batch)
        plan = plan_admissions(view, requests, batch, is_strict=False, max_spread=spread)
        floor = int(self.config.drain_floor * view.max_batch_size)
        if plan.admit_batch or not batch or len(view.running) > floor:
            return plan
        return self._switch(view, requests, batch, unswitched=plan)

    def _switch(self, view: BoundaryView, requests: Sequence[SeqView],
                batch: Sequence[SeqView], unswitched: BoundaryPlan) -> BoundaryPlan:
        """A batch switch once the old batch has drained to its stragglers: running seqs
        and candidate requests that do not fit ``max_spread`` with the candidate batch
        return to the pool, then admission runs again on the room they free. If the
        candidate batch would not get in even then, nothing is returned: ``unswitched``,
        the plan without the switch, stands."""
        spread = self.config.max_spread
        assert spread is not None, "only strict alignment switches this way"
        batch_range = LengthRange.of(s.length for s in batch)
        stale = [s for s in (*view.running, *view.candidate_requests)
                 if not batch_range.fits(s.length, spread)
                 and self.may_return(view, s)]
        stale_ids = {s.seq_id for s in stale}
        kept = tuple(s for s in view.running if s.seq_id not in stale_ids)
        freed = sum(s.num_blocks for s in view.running if s.seq_id in stale_ids)
        after = dataclasses.replace(view, running=kept, free_blocks=view.free_blocks + freed)
        requests = [s for s in requests if s.seq_id not in stale_ids]
        plan = plan_admissions(after, requests, batch, is_strict=False, max_spread=spread)
        if not plan.admit_batch:
            return unswitched
        return dataclasses.replace(plan, to_pool=tuple(s.seq_id for s in stale))


@register_policy
class AlignedLoosePolicy(AlignedStrictPolicy):
    """The paper's rules as written, without the spread bound: a widened prefetch window,
    refills closest in length first, and switches that mix the old and new batch until
    the old one drains (``max_spread`` is ignored)."""

    name = "aligned-loose"

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__(msgspec.structs.replace(config, max_spread=None))
