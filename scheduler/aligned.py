"""The default policy, `aligned`: prefix-aware batching decided by predicted decode
throughput (the driver's step-cost model, scheduler/step_time.py) instead of a fixed length rule.

Where attention pays for the longest sequence of the batch (padded, a per-sequence GPU
kernel) the cost model makes mixed lengths expensive and the policy groups them; where it
does not (paged attention on a CPU, split-K) it keeps batches as wide as the KV holds.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Iterable, Sequence

import msgspec
import numpy as np

from scheduler.aligned_strict import AlignedStrictPolicy
from scheduler.batching import (
    ADMIT_LOOKAHEAD,
    BoundaryPlan,
    BoundaryView,
    SeqView,
    admission_room,
    blocks_needed,
    blocks_to_admit,
    by_arrival,
    ceil_div,
    growth,
    oldest_wait,
    plan_admissions,
    plan_boundary_with,
    plan_evictions,
    take_in_order,
)
from scheduler.policy import PREFILL_LEAD, PolicyConfig, register_policy
from scheduler.step_time import GrowingStep, RunTimes, growing_step, mixing_pays, run_times

CUT_SPAN = 8  # batches' worth of the pool that ``_cheapest_cut`` cuts (decision time)
WASTE_TOLERANCE = 1e-6  # share of an empty step's time below which wastes are equal
SPREAD_TOLERANCE = 1e-3  # share of a step's time below which a spread of lengths is free
# NOTE: latency guard. TPOT counts every wait between two tokens, and an evicted seq waits,
# in the candidate requests buffer, until blocks for all its KV are free: long for a long
# seq on a full decode instance, spread over few tokens. So a seq that has waited through
# more than STALL_STEPS of its instance's steps for its next token goes first, in the order
# it stalled (in a backlog that arrived at once, only one that pads no running seq:
# ``_stalled``). Admissions also leave the running seqs room to grow for HEADROOM_STEPS more
# steps (at most HEADROOM_SHARE of the instance's blocks), so that evictions become rare;
# the stall bound alone does not keep P99 TPOT down. That room is held back from the
# candidate batch too, whose seqs wait for their second token meanwhile, so it shrinks as
# the candidate batch waits: to none once it has waited HEADROOM_STEPS steps, as long as
# the room was meant to protect the running seqs for (``headroom_kept``). Waits are counted
# in the instance's boundaries, not seconds, so timing noise cannot move these decisions.
HEADROOM_STEPS = 64
HEADROOM_SHARE = 0.125
STALL_STEPS = 32
WAITS_KEPT = 4096  # boundaries after which a wait no instance shows again is forgotten
# NOTE: the tail of a backlog where grouping cannot pay. Once nothing is pooled and no batch
# is staged, the candidate requests are evicted seqs waiting for blocks that only finishing
# seqs free, and arrival order lets the longest-evicted of them sit out that whole stretch,
# to finish alone, steps after the rest, whatever is left of its output. So there a seq
# stalled SWAP_STEPS boundaries takes the room of running seqs (``arrival_victims`` first)
# that have made SWAP_STEPS tokens since they joined: each pause of the tail is bounded,
# and no seq waits on its own at the end. Each swap is two KV copies per SWAP_STEPS steps.
SWAP_STEPS = 8


def _first_cut_vectorised(times: RunTimes, items: Sequence[tuple[int, object, int]],
                          max_blocks: int, max_requests: int) -> int:
    """``AlignedPolicy._first_cut`` with the model's vectorised step times (``run_times``):
    the batches that start at one item, all its lengths at once. Items are in length order,
    so a batch's longest is its last."""
    n = len(items)
    if not n:
        return 0
    lengths = np.array([item[0] for item in items], dtype=np.int64)
    tokens = np.concatenate(([0], np.cumsum(lengths)))
    blocks = np.concatenate(([0], np.cumsum([item[2] for item in items])))
    best = np.full(n + 1, math.inf)
    best[0] = 0.0
    back = np.zeros(n + 1, dtype=np.int64)
    for i in range(n):
        if math.isinf(best[i]):
            continue
        # batches items[i:j + 1] within the room: j + 1 <= end
        end = min(n, i + max_requests,
                  int(np.searchsorted(blocks, blocks[i] + max_blocks, side="right")) - 1)
        if end <= i:
            continue
        j = np.arange(i, end)
        cand = best[i] + times(j - i + 1, tokens[j + 1] - tokens[i], lengths[j])
        better = cand < best[i + 1:end + 1]
        best[i + 1:end + 1][better] = cand[better]
        back[i + 1:end + 1][better] = i
    return _first_batch(best.tolist(), back.tolist())


def _first_batch(best: Sequence[float], back: Sequence[int]) -> int:
    """The size of the first batch of the cheapest cut that the dynamic program's least
    costs ``best`` and back-pointers ``back`` (both by items covered) give."""
    end = len(best) - 1
    while math.isinf(best[end]) and end > 0:  # the span's last requests may not fit
        end -= 1
    first = end
    while back[first] > 0:
        first = int(back[first])
    return int(first)


@register_policy
class AlignedPolicy(AlignedStrictPolicy):
    """Cost-aware prefix-aware batching: DFS's candidate subtrees, refills and batch
    switches are weighed by the step-cost model (see ``waste``)."""

    name = "aligned"
    uses_step_cost = True
    arrival_admission_is_strict = False  # see ``_plan_in_arrival_order``

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__(msgspec.structs.replace(config, max_spread=None))
        self._slots = 1  # the device's batch slots, learned at the first boundary
        # the ideal per-token cost line (base, slope) and what it was probed for: the step
        # model, its version (``num_fits``: a driver may refit it) and the slots
        self._line: tuple[float, float] | None = None
        self._line_key: tuple[object, ...] = ()
        # per decision: the refilled batch's step as admissions grow it (``_lowers_waste``),
        # and the step times asked so far and in the last decision (the same lengths are
        # costed by several rules)
        self._refill: Refill | None = None
        self._running_step: tuple[list[int], GrowingStep] | None = None  # (lengths, step)
        self._times: dict[tuple[int, ...], float] = {}
        self._last_times: dict[tuple[int, ...], float] = {}
        self._last_arrival = -math.inf  # the latest arrival seen so far (starvation_clock)
        self._pays: dict[tuple[int, int], bool] = {}  # alignment_pays by (shortest, longest)
        # boundaries waited by each candidate request and candidate batch (``_count_waits``):
        # key -> (its wait_start, boundaries waited, the tick it was last seen)
        self._waits: dict[tuple[str, object], tuple[float, int, int]] = {}
        self._tick = 0  # plan_boundary calls so far
        self._joined: dict[str, int] = {}  # seq -> tokens it had when admitted (``_swap``)
        # the last cut of the pool and the waiting prompts (``_next_batch``): what it cut
        # (their lengths and blocks, the room, the model) and its first batch's size
        self._last_cut: tuple[tuple[object, ...], int] | None = None
        # the decode instances' running batch (``current_batch_id``) and the time its first
        # boundary was seen (``prefill_quota``; none yet: a backlog before its first batch)
        self._batch: int | None = None
        self._batch_start = math.inf

    def add(self, seq: SeqView) -> None:
        super().add(seq)
        self._last_arrival = max(self._last_arrival, seq.arrival_time)

    def starvation_clock(self, now: float) -> float:
        """Starvation is being overtaken by later arrivals, so its clock is the latest
        arrival seen so far, pooled or at a boundary (never past ``now``): a request starves
        once requests that arrived more than the threshold after its last progress are
        served or waiting beside it.

        NOTE: measured from ``now``, every request of a backlog that arrives at once
        (offline) starves once the threshold has passed, and serving them in arrival order,
        alignment aside, mixes long and short seqs where each step pays for the longest,
        costing throughput and, since a backlog's P99 TPOT is set by its makespan, latency
        too. Such a backlog is finite, so it drains in the order the cost model prefers
        (liveness as with the threshold off); under a stream the latest arrival is about
        ``now`` and the threshold bounds waits as before."""
        return min(now, self._last_arrival)

    def _begin(self, slots: int) -> None:
        """A decision starts: its cost figures are taken afresh where the model changed."""
        self._model_changed(slots)
        self._refill = None
        self._running_step = None
        # the last decision's step times stay at hand for one more (a staged candidate batch
        # is costed at every boundary while it waits) unless the model changed (then both
        # are empty)
        self._last_times, self._times = self._times, {}

    def _model_changed(self, slots: int) -> bool:
        """Whether the model (or the slots, at least ``slots``) changed since the cost
        figures that depend on it were taken; if so, they are dropped."""
        self._slots = max(self._slots, slots)
        key = (self.step_time, getattr(self.step_time, "num_fits", 0), self._slots)
        if key == self._line_key:
            return False
        self._line, self._line_key = None, key
        self._pays.clear()
        self._times, self._last_times = {}, {}
        return True

    def _time(self, lengths: Sequence[int]) -> float:
        """``step_time``, each batch costed once within a decision (and the one before)."""
        key = tuple(lengths)
        time = self._times.get(key)
        if time is None:
            time = self._last_times.get(key)
            self._times[key] = time = self.step_time(key) if time is None else time
        return time

    def ideal(self, length: float) -> float:
        """Predicted step time per token in a full batch of seqs of one ``length``: linear
        in the length (weights and overheads shared by ``slots`` seqs, plus the KV read),
        so two probes of the model give it for every length."""
        if self._line is None:
            slots, top = self._slots, self.config.max_len
            base = self.step_time([1] * slots) / slots
            self._line = (base, (self.step_time([top] * slots) / slots - base) / (top - 1))
        base, slope = self._line
        return base + slope * (length - 1)

    # -- the cost model ------------------------------------------------------------------
    def waste(self, lengths: Sequence[int]) -> float:
        """Predicted step time per token beyond what the same tokens cost in full batches
        of one length each (0: no waste): padding, imbalance, and the fixed part of a step
        left unshared by a small batch.

        Raw tokens per second would always favour the shortest requests and leave the long
        ones for later, half-empty batches; charging each token only the waste lets every
        length be served at its own cost (``ideal``, linear in the length, so the tokens'
        ideal cost is that of their mean length).
        """
        if not lengths:
            return 0.0
        n = len(lengths)
        return self._time(lengths) / n - self.ideal(sum(lengths) / n)

    def _less_waste(self, waste: float, than: float) -> bool:
        """Whether waste ``waste`` is less than ``than``, beyond rounding."""
        return waste < than - WASTE_TOLERANCE * self.ideal(1) * self._slots

    def _lengths(self, ids: Sequence[str]) -> list[int]:
        return self.tree.lengths(ids)

    # -- the pool ------------------------------------------------------------------------
    def search(self, max_blocks: int, min_requests: int, max_requests: int) -> list[str]:
        """(A starving request's subtree goes first, as ``aligned-strict``.) Where a spread
        of lengths costs nothing (split-K), the oldest first, as fcfs takes them. Else the
        shortest batch of the cheapest cut of the pool into batches of neighbouring lengths
        (``_cheapest_cut``), unless requests are on their way to the pool on a device that
        also decodes (``incoming``) and one of them could join that batch (the pool fits in
        one batch, or one of them is shorter than the batch's longest). Then nothing, until
        the pool holds what the cut looks at (``CUT_SPAN`` batches).

        NOTE: where prefill and decode share a device, decoding what is pooled while the
        rest is still being prefilled spends no less of the device's time, and batches the
        first requests to arrive, whatever their lengths; the refills then join that mix
        and every step pads to its longest. Such a device prefills shortest first
        (``prefills_shortest_first``), so a backlog reaches the pool shortest first: once
        the pool's shortest batch is cut and nothing shorter is on its way, waiting would
        not change that batch, and it decodes while the longer prompts are prefilled (a
        step fused into a prefill shares its weights). A stream's later arrivals may be
        shorter; the wait for them ends once the pool holds what the cut looks at, and a
        starving request is served first. Where a spread of lengths costs nothing
        (split-K) waiting saves only a step's fixed part over the first few seqs, while
        they wait for their second token through every prefill left, a wait P99 TPOT
        counts; so there the pool decodes at once.

        NOTE: how wide a batch should be is the model's call, not a request count's: a
        batch asked to hold ``min_requests`` (density-first search widens a subtree by its
        siblings until it does) mixes short and long prompts, and every step pads the short
        ones to the longest, while a narrow one leaves a step's fixed part unshared. The cut
        weighs both, over the whole pool."""
        self._begin(max_requests)
        root = self.tree.root
        if root.num_requests == 0:
            return []
        fits = root.num_blocks <= max_blocks and root.num_requests <= max_requests
        if not fits and not self.alignment_pays():
            return take_in_order(self.tree.oldest_first(), max_blocks, max_requests)
        seen = (root.num_blocks > CUT_SPAN * max_blocks
                or root.num_requests > CUT_SPAN * max_requests)
        wait = (bool(self.incoming) and not seen
                and self.alignment_pays([1, self.config.max_len]))
        if wait and fits:
            return []  # any request on its way could join the pool's batch
        batch = self._cheapest_cut(root.requests(), max_blocks, max_requests)
        if wait and batch and min(self.incoming) < max(self._lengths(batch)):
            return []  # a shorter request on its way could join the batch
        return batch

    def prefills_shortest_first(self) -> bool:
        """Where a spread of lengths costs (``alignment_pays``): the first batch ``search``
        cuts from a backlog is then its shortest requests, ready after the first prefills."""
        return self.alignment_pays([1, self.config.max_len])

    def prefill_quota(self, num_unstarted: int, running: Sequence[int],
                      waiting: Sequence[tuple[int, int, float]]) -> int:
        """The prompts that start decoding soon once prefilled (asked where prefill goes
        shortest first, ``prefills_shortest_first``):

        - while the running batch is above its ``drain_floor`` (of the running seqs and
          those prefilled and not started): those it would take as refills (``_joins``),
          or the pool's next batch (``_next_batch``) where that batch would join it
          (``mixing_pays``); none while as many prefilled requests wait for their first
          decode step as it runs (and at least ``PREFILL_LEAD``): the lead;
        - once it is at its floor (or nothing runs): the pool's next batch.

        Only a backlog that the running batch passed over is held so: while a prompt that
        arrived after the running batch started waits (a stream), the prompts wait only for
        that lead, as do prompts overtaken by later arrivals (``PREFILL_PASSES``: first in
        ``waiting``, before its shortest).

        NOTE: a prefilled request has its first token, and TPOT counts its wait for the
        second. The batches go shortest first as the prompts do, so a longer prompt joins
        no running batch of shorter ones where each step would pad them all to it:
        prefilled at once, a long prompt with a short output got its first token in a
        backlog's first seconds and its second once the running batch had drained, a wait
        spread over its few tokens. Held, that wait comes before its first token, and the
        device prefills it later instead of sooner. Where a step's fixed part outweighs
        the padding, the next batch would join the running one, and is prefilled as soon
        as it would. Under a stream the wait would fall on a new arrival's first token
        instead (P99 TTFT many times fcfs's on a loaded device), so there prompts are
        prefilled as they come, paced by the lead."""
        if not waiting:
            return 0
        lead = max(PREFILL_LEAD, len(running)) > num_unstarted
        shortest = min(length for length, _, _ in waiting)
        due = next(i for i, (length, _, _) in enumerate(waiting) if length == shortest)
        if due:
            return due if lead else 0
        if any(at > self._batch_start for _, _, at in waiting):
            return len(waiting) if lead else 0
        if len(running) <= self.config.drain_floor * (len(running) + num_unstarted):
            return self._next_batch(waiting)[0]
        if not lead:
            return 0
        joins = self._joins(running, waiting)
        if joins == 0:
            taken, lengths = self._next_batch(waiting)
            if mixing_pays(self._time, running, lengths):
                return taken
        return joins

    def _joins(self, running: Sequence[int], waiting: Sequence[tuple[int, int, float]]
               ) -> int:
        """How many of the ``waiting`` prompts, in order, a running batch of ``running``
        lengths would take as refills (each joining it ``waste``s no more per token than
        the batch with the ones before it).

        NOTE: asked between decisions (at every boundary while a prefill may be held), so it
        keeps the decisions' step times (``_begin`` would put the last one's aside)."""
        self._model_changed(self._slots)
        lengths = list(running)
        step = growing_step(self.step_time, lengths, self._time)
        size, total = len(lengths), sum(lengths)
        waste = self._step_waste(step, size, total)
        for i, (length, _, _) in enumerate(waiting):
            step.add(length)
            size, total = size + 1, total + length
            grown = self._step_waste(step, size, total)
            if self._less_waste(waste, grown):
                return i
            waste = grown
        return len(waiting)

    def _next_batch(self, waiting: Sequence[tuple[int, int, float]]
                    ) -> tuple[int, list[int]]:
        """The first batch of the cheapest cut of the pool and the ``waiting`` prompts
        (length, blocks, arrival; shortest first) within ``batch_room``: how many of the prompts it
        takes, and its lengths (all prompts and none where the room is not known).

        NOTE: decision time. Asked at every boundary while a prefill may be held, and a cut
        costs O(requests × ``max_requests``) growing steps; as prompts are prefilled they
        only move from ``waiting`` to the pool, so the cut of the two together is kept
        until a request enters or leaves them (an arrival, a batch taken)."""
        room = self.batch_room
        if room is None:
            return len(waiting), []
        span = CUT_SPAN * room[1]
        pool = itertools.islice(self.tree.root.requests(), span)
        tagged = [(length, None, blocks) for length, blocks, _ in waiting[:span]]
        items = list(heapq.merge(pool, tagged, key=lambda item: item[0]))[:span]
        key = (tuple((length, blocks) for length, _, blocks in items), room,
               self.step_time, getattr(self.step_time, "num_fits", 0))
        if self._last_cut is not None and self._last_cut[0] == key:
            first = self._last_cut[1]
        else:
            # NOTE: at least the shortest: where no batch's room holds it (a prompt of more
            # blocks than ``batch_room`` allows), it is decoded on its own, not cut, and a
            # hold for its batch would never end
            first = max(1, self._first_cut(items, *room)) if items else 0
            self._last_cut = (key, first)
        return (sum(1 for item in items[:first] if item[1] is None),
                [item[0] for item in items[:first]])

    def matching(self, lo: int, hi: int, max_blocks: int, max_requests: int,
                 now: float) -> list[str]:
        """(None while a request starves, as ``aligned-strict``.) Pooled requests in the
        window, shortest first while they fit; none where ``alignment_pays`` says no: there
        the pool is served as fcfs serves it, one batch at a time.

        NOTE: where grouping cannot pay, a dynamic prefetch has nothing to match, and what
        it does is bind pooled requests to one decode instance early. Matching within the
        window keeps the long requests out until a tail of small closing steps; matching
        oldest first of any length binds them to whichever instance asked first, and with
        several decode instances the others run dry while it works through them. With no
        dynamic prefetch here, `aligned` takes its batches oldest first where alignment
        cannot pay."""
        if self.starving_request(now) is not None or self.alignment_pays([max(lo, 1), hi]):
            return super().matching(lo, hi, max_blocks, max_requests, now)
        return []

    def matching_share(self, running: Sequence[Sequence[int]], instance: int) -> float:
        """The fastest busy instance's predicted step time over ``instance``'s (1 where it
        is the fastest, or the only one busy).

        NOTE: balance across decode instances. A window covers the lengths of its running
        batch, so an instance whose batch holds a long prompt reports the widest one, and
        every long prompt pooled after it matches that window alone: where a step pays for
        its longest seq, that instance's steps are the slowest, and as long as it also takes
        as many short requests as the others it ends a backlog last, seconds after them.
        Each instance takes matching requests in proportion to its pace, so one that steps
        at half the fastest's rate fills half its room."""
        if not running[instance]:
            return 1.0
        times = {i: self.step_time(lengths) for i, lengths in enumerate(running) if lengths}
        return min(times.values()) / times[instance]

    def alignment_pays(self, lengths: Sequence[int] = ()) -> bool:
        """Whether the model charges a batch for its spread of lengths: a full batch of half
        the shortest and half the longest of the pool and ``lengths`` (a running batch's
        window, the lengths at a boundary) is predicted slower than one of the same size
        and the same total KV in equal lengths (padded attention pays for the longest, a
        per-sequence kernel for its imbalance; a paged or split-K step costs its total
        work, so there grouping by length cannot pay).

        NOTE: where it cannot, density-first search would still choose the densest,
        shortest subtrees and leave the longest requests for last, to decode in a tail of
        small steps with a high P99 TPOT. There the pool is served oldest first, as fcfs
        serves it."""
        # NOTE: the pool alone near the end of a backlog holds one request or none, and then
        # says nothing: dynamic prefetch would take any length, and a padded run would mix
        # its last long requests into short batches. So the lengths at hand count too.
        root = self.tree.root
        if root.num_requests:
            lengths = [*lengths, next(root.requests())[0], next(root.requests(reverse=True))[0]]
        if not lengths:
            return False
        shortest, longest = min(lengths), max(lengths)
        if shortest == longest:
            return False
        pays = self._pays.get((shortest, longest))
        if pays is None:  # asked at every boundary: once per pair of lengths and model
            half = max(1, self._slots // 2)
            middle = (shortest + longest) // 2
            spread = self._time([shortest] * half + [longest] * half)
            equal = self._time([middle] * half + [shortest + longest - middle] * half)
            pays = self._pays[shortest, longest] = spread > equal * (1 + SPREAD_TOLERANCE)
        return pays

    def _cheapest_cut(self, pool: Iterable[tuple[int, str, int]], max_blocks: int,
                      max_requests: int) -> list[str]:
        """The first batch of the cheapest cut of ``pool`` ((length, id, blocks) in length
        order) into batches of consecutive requests, each within ``max_blocks`` and
        ``max_requests``: a dynamic program for the least sum of the batches' predicted
        step times, every batch taken to run as many steps (a policy does not know how long
        a seq will run). The same partition as sim/bound.py's search, on what a policy
        knows.

        NOTE: decision time. The program costs O(pool × ``max_requests``) growing steps
        (O(1) each with the model's incremental form; with its vectorised form, one array
        operation per request, ``run_times``); only the first ``CUT_SPAN`` batches'
        worth of the pool is cut, since the first batch is the one taken now and the rest
        are cut again, with more requests, when their turn comes."""
        items = list(itertools.islice(pool, CUT_SPAN * max_requests))
        first = self._first_cut(items, max_blocks, max_requests)
        return [seq_id for _, seq_id, _ in items[:first]]

    def _first_cut(self, items: Sequence[tuple[int, object, int]], max_blocks: int,
                   max_requests: int) -> int:
        """How many of ``items`` ((length, id, blocks) in length order) the first batch of
        their cheapest cut takes (``_cheapest_cut``)."""
        times = run_times(self.step_time)
        if times is not None:
            return _first_cut_vectorised(times, items, max_blocks, max_requests)
        n = len(items)
        best = [0.0] + [math.inf] * n
        back = [0] * (n + 1)
        for i in range(n):
            if math.isinf(best[i]):
                continue
            step = growing_step(self.step_time, [], self._time)
            held = 0
            for j in range(i, min(n, i + max_requests)):
                held += items[j][2]
                if held > max_blocks:
                    break
                step.add(items[j][0])
                cand = best[i] + step.time()
                if cand < best[j + 1]:
                    best[j + 1], back[j + 1] = cand, i
        return _first_batch(best, back)

    # -- the boundary --------------------------------------------------------------------
    def plan_boundary(self, view: BoundaryView) -> BoundaryPlan:
        """Starving seqs first, strictly in arrival order (as ``aligned-strict``); short of
        room, evict the old batch's longest, then the current batch's. Where grouping cannot
        pay (``alignment_pays`` over the pool and the lengths at hand), arrival order
        (``_plan_in_arrival_order``: evict the latest arrivals first, admit the oldest first,
        or in a backlog's tail the longest waiting, past one that does not fit yet).
        Otherwise, candidate requests stalled beyond ``STALL_STEPS`` steps go first
        (``_stalled``: while later arrivals came, or within the running seqs' lengths),
        strictly in the order they stalled (nothing else joins until they do). Otherwise,
        with ``HEADROOM_STEPS`` of
        growth kept free (``with_headroom``; less as the candidate batch waits,
        ``headroom_kept``):

        - a candidate request joins when it does not raise the running batch's ``waste``
          per token (a refill that raises predicted throughput for its work);
        - the candidate batch joins the running seqs (oldest first, as room allows) when
          one step over both is predicted no slower than a step of each
          (``mixing_pays``), and where only part of it fits, when that part is predicted
          cheaper with the running seqs than with the rest of its batch (``_part_pays``;
          until the candidate batch has waited ``STALL_STEPS`` boundaries). Else the
          running batch drains first, down to ``drain_floor``
          of the running seqs and the candidate batch; then its stragglers that would not
          mix go back to the pool (each seq at most ``MAX_RETURNS`` times) and the
          candidate batch takes their room.
        """
        self._begin(view.max_batch_size)
        if view.current_batch_id != self._batch:
            self._batch, self._batch_start = view.current_batch_id, view.now
        self._last_arrival = max(self._last_arrival, max(
            (s.arrival_time for seqs in (view.running, view.candidate_requests,
                                         view.candidate_batch) for s in seqs),
            default=self._last_arrival))
        waited = self._count_waits(view)
        batch_wait = oldest_wait(view.candidate_batch) if view.candidate_batch else None
        if self.is_starving(view, view.candidate_requests) or (
                batch_wait is not None and self._past_threshold(view, batch_wait)):
            return super().plan_boundary(view)
        running = [s.length for s in view.running]
        if not self.alignment_pays([*running, *(s.length for s in (
                *view.candidate_requests, *view.candidate_batch))]):
            plan = self._plan_in_arrival_order(view)
            if plan == BoundaryPlan():
                plan = self._swap(view, waited)
            self._note_joins(view, plan)
            return plan
        # NOTE: one pass over the running seqs for the growth that admissions reserve; the
        # next step's own growth is at most that, so only a larger one can call for evictions.
        reserve = growth(view.running, view.block_size, ADMIT_LOOKAHEAD)
        if reserve > view.free_blocks:
            evict = plan_evictions(view, lambda: self._victims(view))
            if evict:
                return BoundaryPlan(evict=evict)
        if running and view.candidate_requests:  # a refill may follow: its step, costed
            # once for the stall bound and the refill's first question alike
            step = growing_step(self.step_time, running, self._time)
            self._times.setdefault(tuple(running), step.time())
            self._running_step = (running, step)
        stalled = self._stalled(view, waited)
        if stalled:
            return plan_admissions(view, stalled, [], is_strict=True, reserve=reserve)
        view = with_headroom(view, self.headroom_kept(waited.get(("batch", None), 0)))
        current = ([s for s in view.running if s.batch_id == view.current_batch_id]
                   if view.candidate_requests else [])  # only refills look at it
        requests = self._closest_first(view, current)
        batch = by_arrival(view.candidate_batch)
        if not batch or mixing_pays(self._time, running, [s.length for s in batch]):
            plan = plan_admissions(view, requests, batch, is_strict=False,
                                   accepts=self._lowers_waste, reserve=reserve,
                                   lengths=running)
            if (waited.get(("batch", None), 0) > STALL_STEPS
                    or self._part_pays(view, plan, batch)):
                return plan
        plan = plan_admissions(view, requests, [], is_strict=False,
                               accepts=self._lowers_waste, reserve=reserve, lengths=running)
        # NOTE: the floor is a share of the seqs at hand, not of the slots: batches cut by
        # the model can be far narrower than the slots, and a floor of the slots would then
        # send most of a running batch back to the pool, to rejoin later batches it pads.
        floor = int(self.config.drain_floor * (len(view.running) + len(batch)))
        if len(view.running) > floor:
            return plan
        return self._switch_to(view, batch, unswitched=plan)

    def _part_pays(self, view: BoundaryView, plan: BoundaryPlan,
                   batch: Sequence[SeqView]) -> bool:
        """Whether the part of the candidate ``batch`` that ``plan`` admits is better run
        with the running seqs (and the requests ``plan`` admits) now than with the rest of
        its batch later: one step of each pair, predicted.

        NOTE: ``mixing_pays`` weighs the whole candidate batch joining. A part of it joins
        where only the part fits, and one step over both groups then still beats a step of
        each (the weights are read once), but the part's alternative is its own batch, not
        a step alone: a candidate batch of longer seqs sends its first seq into the running
        batch of short ones, and every step pads them all to it until the short ones are
        done, while the rest of its batch, which pads to its own longest anyway, would
        have carried it for little more."""
        admitted = set(plan.admit_batch)
        if not admitted or len(admitted) == len(batch):
            return True
        joined = {*plan.admit_requests}
        now = [s.length for s in view.running] + [
            s.length for s in view.candidate_requests if s.seq_id in joined]
        part = [s.length for s in batch if s.seq_id in admitted]
        rest = [s.length for s in batch if s.seq_id not in admitted]
        return (self._time([*now, *part]) + self._time(rest)
                <= self._time(now) + self._time([*part, *rest]))

    def _plan_in_arrival_order(self, view: BoundaryView) -> BoundaryPlan:
        """The boundary where grouping cannot pay: short of room, evict in
        ``arrival_victims`` order (the latest arrivals first); otherwise admit the
        candidates (requests and batch together) in ``arrival_admissions`` order (the oldest
        first; in a backlog's tail the longest waiting first), past one that does not fit
        yet (``arrival_admission_is_strict``: stopping there, as fcfs does).

        NOTE: where a step costs its total work, every schedule reads the same KV, and what
        it pays beyond that is a step's fixed part per step. Arrival order bounds every
        wait: an evicted seq is older than the fresh ones behind it and goes back in first.
        Serving the most output left first instead (evict the seqs with the most tokens
        generated, admit the fewest generated first) saves some of a backlog's tail, but an
        evicted seq then waits behind every fresh seq of the backlog, and each such wait
        falls on a few tokens, so P99 TPOT rose well above fcfs's on most of the split-K
        family (docs/results-policy.md; benchmarks/test_bench_split_k_rules.py compares
        such orders). Admission passes a seq that does not fit yet, unlike fcfs's, so the
        batch stays as wide as the blocks allow."""
        plan = plan_boundary_with(view, lambda: self.arrival_victims(view), (),
                                  self.arrival_admissions(view),
                                  is_strict=self.arrival_admission_is_strict)
        if plan.evict:
            return plan
        return self._admitting(view, plan.admit_batch)

    @staticmethod
    def _admitting(view: BoundaryView, ids: Sequence[str]) -> BoundaryPlan:
        """The plan that admits ``ids``, candidate requests and candidate batch seqs
        alike, each from where it is staged."""
        requests = {s.seq_id for s in view.candidate_requests}
        return BoundaryPlan(admit_requests=tuple(i for i in ids if i in requests),
                            admit_batch=tuple(i for i in ids if i not in requests))

    def _swap(self, view: BoundaryView, waited: dict[tuple[str, object], int]
              ) -> BoundaryPlan:
        """In a backlog's tail (nothing pooled, no candidate batch; see ``SWAP_STEPS``), the
        first candidate request in ``arrival_admissions`` order that has waited
        ``SWAP_STEPS`` boundaries joins in place of running seqs, in ``arrival_victims``
        order, that have made ``SWAP_STEPS`` tokens since they joined, as many as its
        blocks and growth need; none if that many cannot free its room."""
        if len(self) or view.candidate_batch or not view.candidate_requests:
            return BoundaryPlan()
        seq = next((s for s in self.arrival_admissions(view)
                    if waited.get(("seq", s.seq_id), 0) >= SWAP_STEPS), None)
        if seq is None:
            return BoundaryPlan()
        room, slots = admission_room(view)
        need = blocks_to_admit(seq, view.block_size, ADMIT_LOOKAHEAD)
        victims = []
        for victim in self.arrival_victims(view):
            if room >= need and slots > 0:
                break
            if victim.num_output_tokens - self._joined.get(victim.seq_id, 0) < SWAP_STEPS:
                continue
            victims.append(victim.seq_id)
            room += victim.num_blocks + blocks_needed(victim, view.block_size, ADMIT_LOOKAHEAD)
            slots += 1
        if not victims or room < need or slots <= 0:
            return BoundaryPlan()
        return BoundaryPlan(evict=tuple(victims), admit_requests=(seq.seq_id,))

    def _note_joins(self, view: BoundaryView, plan: BoundaryPlan) -> None:
        """Remembers the tokens each seq ``plan`` admits has so far (``_swap`` counts a
        victim's tokens from there); forgets seqs no longer at the boundary now and then."""
        admitted = {*plan.admit_requests, *plan.admit_batch}
        if not admitted:
            return
        for s in (*view.candidate_requests, *view.candidate_batch):
            if s.seq_id in admitted:
                self._joined[s.seq_id] = s.num_output_tokens
        if len(self._joined) > WAITS_KEPT:
            here = {s.seq_id for s in (*view.running, *view.candidate_requests,
                                       *view.candidate_batch)}
            self._joined = {k: v for k, v in self._joined.items() if k in here}

    def arrival_victims(self, view: BoundaryView) -> list[SeqView]:
        """Eviction order where grouping cannot pay: the latest arrivals first."""
        return by_arrival(view.running)[::-1]

    def arrival_admissions(self, view: BoundaryView) -> list[SeqView]:
        """Admission order where grouping cannot pay: the candidate requests and the
        candidate batch together, oldest first; in a backlog's tail (nothing pooled, and
        nothing arrived since the candidates began to wait), the longest waiting for its
        next token first (``SeqView.wait_start``; ties oldest first).

        NOTE: in the tail the candidates are the last batch's seqs, waiting for their
        second token since their prefill, and evicted seqs, waiting since their eviction
        with part of their output behind them. Arrival order puts the evicted seqs first,
        and the last batch's seqs, all their output ahead, join last and end the backlog
        alone in a stretch of narrow steps. Longest waiting first lets those in first and
        bounds every wait alike. Before the tail the pool keeps sending seqs that have
        waited since their prefill, and an evicted seq would wait behind each of them, a
        wait its few remaining tokens share (P99 TPOT well above fcfs's on the split-K
        family: benchmarks/test_bench_split_k_rules.py); there arrival order brings it back
        before them. Under a stream the pool empties between arrivals, but a request that
        arrived after a candidate began to wait says the backlog goes on: arrival order
        there too."""
        seqs = by_arrival((*view.candidate_requests, *view.candidate_batch))
        if len(self) or not seqs or self._last_arrival >= min(s.wait_start for s in seqs):
            return seqs
        return sorted(seqs, key=lambda s: s.wait_start)  # stable: ties stay oldest first

    @staticmethod
    def _victims(view: BoundaryView) -> list[SeqView]:
        """Eviction order: the old batch's seqs, then the current batch's, longest first."""
        return sorted(view.running, key=lambda s: (s.batch_id == view.current_batch_id,
                                                   -s.length))

    def _count_waits(self, view: BoundaryView) -> dict[tuple[str, object], int]:
        """Boundaries of this instance that each candidate request (key ("seq", id)) and the
        candidate batch (("batch", None)) have waited through without progress, this one
        included: a count kept across calls, restarted when a wait starts anew."""
        self._tick += 1
        waits: dict[tuple[str, object], float] = {
            ("seq", s.seq_id): s.wait_start for s in view.candidate_requests}
        if view.candidate_batch:
            batch_id = min(s.batch_id for s in view.candidate_batch)
            waits["batch", batch_id] = oldest_wait(view.candidate_batch)
        counts: dict[tuple[str, object], int] = {}
        for key, start in waits.items():
            seen = self._waits.get(key)
            count = seen[1] + 1 if seen is not None and seen[0] == start else 1
            self._waits[key] = (start, count, self._tick)
            counts[("batch", None) if key[0] == "batch" else key] = count
        if len(self._waits) > WAITS_KEPT:  # forget what no instance has shown for a while
            self._waits = {k: v for k, v in self._waits.items()
                           if self._tick - v[2] <= WAITS_KEPT}
        return counts

    def _stalled(self, view: BoundaryView, waited: dict[tuple[str, object], int]
                 ) -> list[SeqView]:
        """Candidate requests (evicted seqs, mostly) that have waited through more than
        ``STALL_STEPS`` boundaries for a token, longest stalled first: where later arrivals
        came meanwhile (as starvation, ``starvation_clock``), or where they are no longer
        than the longest running seq.

        NOTE: a backlog that arrived at once (offline) is finite and drains in the order
        the cost model prefers, as under the starvation threshold, except that a seq the
        running batch spans joins it after the bound (it pads no one else; left out, such
        seqs made a last batch of their own, too small to pay for its steps). Forced in
        after the bound, a backlog's longer leftovers joined a long-running batch one by
        one, each a little longer than its longest, and padded its every seq for the rest
        of its life."""
        stalled = [s for s in view.candidate_requests
                   if waited.get(("seq", s.seq_id), 0) > STALL_STEPS]
        if not stalled:  # the common case: no pass over the running seqs
            return []
        clock = self.starvation_clock(view.now)
        longest = max((s.length for s in view.running), default=0)
        return sorted((s for s in stalled if clock > s.wait_start or s.length <= longest),
                      key=lambda s: (s.wait_start, s.seq_id))

    @staticmethod
    def headroom_kept(batch_waited: int) -> float:
        """The share of the headroom kept once the candidate batch has waited through
        ``batch_waited`` boundaries (0: there is none): 1 at first, less as it waits, 0
        after ``HEADROOM_STEPS``."""
        if not batch_waited or not HEADROOM_STEPS:
            return 1.0
        return max(0.0, 1.0 - batch_waited / HEADROOM_STEPS)

    def _lowers_waste(self, lengths: list[int], seq: SeqView) -> bool:
        """Whether ``seq`` joining seqs of ``lengths`` wastes no more per token.

        NOTE: decision time. The admission loop asks this of each candidate in turn with one
        list, ``lengths``, that only grows (admitted seqs are appended), so the batch is
        costed as a ``growing_step``: with the model's incremental form a candidate costs
        O(1), not a pass over every running seq."""
        if not lengths:
            return True
        refill = self._refill
        if refill is None or refill.lengths is not lengths:
            running = self._running_step
            self._running_step = None  # the refill grows it: it serves one refill only
            step = (running[1] if running is not None and running[0] == lengths
                    else growing_step(self.step_time, lengths, self._time))
            size, total = len(lengths), sum(lengths)
            self._refill = refill = Refill(lengths, step, size, total,
                                           self._step_waste(step, size, total))
        elif refill.size != len(lengths):  # seqs were admitted since the last question
            for length in lengths[refill.size:]:
                refill.step.add(length)
            refill.size, refill.total = len(lengths), sum(lengths)
            refill.waste = self._step_waste(refill.step, refill.size, refill.total)
        size, total = refill.size, refill.total
        joined = (refill.step.time_with(seq.length) / (size + 1)
                  - self.ideal((total + seq.length) / (size + 1)))
        return not self._less_waste(refill.waste, joined)

    def _step_waste(self, step: GrowingStep, size: int, total: int) -> float:
        """``waste`` of the ``size`` lengths summing to ``total`` that ``step`` holds."""
        return step.time() / size - self.ideal(total / size)

    def _switch_to(self, view: BoundaryView, batch: Sequence[SeqView],
                   unswitched: BoundaryPlan) -> BoundaryPlan:
        """The old batch has drained to its stragglers: those that would not mix with the
        candidate batch (and ``may_return``) go back to the pool,
        then the candidate batch is admitted in the room they free. ``unswitched`` stands
        if the candidate batch would not get in even then."""
        lengths = [s.length for s in batch]
        stale = [s for s in view.running
                 if self.may_return(view, s)
                 and not mixing_pays(self._time, lengths, [s.length])]
        stale_ids = {s.seq_id for s in stale}
        kept = tuple(s for s in view.running if s.seq_id not in stale_ids)
        freed = sum(s.num_blocks for s in stale)
        after = dataclasses.replace(view, running=kept, free_blocks=view.free_blocks + freed)
        plan = plan_admissions(after, [], batch, is_strict=False)
        if not plan.admit_batch:
            return unswitched
        return dataclasses.replace(plan, to_pool=tuple(sorted(stale_ids)))


@dataclasses.dataclass(slots=True)
class Refill:
    """The batch an admission loop refills: its lengths list (the loop's own, appended to
    as seqs are admitted), its step, and the count, sum and waste of the lengths in it."""

    lengths: list[int]
    step: GrowingStep
    size: int
    total: int
    waste: float  # ``waste`` of the lengths in the step


def with_headroom(view: BoundaryView, kept: float = 1.0) -> BoundaryView:
    """``view`` with the running seqs' growth over ``HEADROOM_STEPS`` steps (at most
    ``HEADROOM_SHARE`` of the instance's blocks), times ``kept``, taken out of its free
    blocks: what admissions may fill without an eviction soon after."""
    if not view.running or not HEADROOM_STEPS or kept <= 0:
        return view
    growth = ceil_div(len(view.running) * HEADROOM_STEPS, view.block_size)
    if growth > int(HEADROOM_SHARE * view.free_blocks):  # the cap may bind: count the held
        held = sum(s.num_blocks for s in view.running)
        growth = min(growth, int(HEADROOM_SHARE * (held + view.free_blocks)))
    reserve = int(kept * growth)
    return dataclasses.replace(view, free_blocks=max(0, view.free_blocks - reserve))


@register_policy
class AlignedNoPrefetchPolicy(AlignedPolicy):
    """Ablation: the same decisions, but KV goes host -> decode directly, no prefetch."""

    name = "aligned-noprefetch"
    uses_staging = False
    uses_dynamic_prefetch = False

    def matching(self, lo: int, hi: int, max_blocks: int, max_requests: int,
                 now: float) -> list[str]:
        return []
