"""How much any batching policy could win on an offline workload, and how big its bubble is.

``search_decode_time``: the best static schedule found by a search over length-sorted
partitions (each part one decode batch run to completion, the parts one after another;
a dynamic program over every contiguous partition of the requests sorted by prompt length,
then by final length, within the decode instance's blocks and batch size). It is a schedule
a policy could follow, so it says what is within reach, not a proof that nothing does
better: continuous refills can beat it where outputs differ widely.

``ideal_decode_time``: every token at the per-token cost of a full batch of its own length
(no padding, no imbalance, no small batches), a floor no schedule goes below under the model.

``bubble``: what one run's decode steps padded (KV tokens beyond the real ones) and the
share of their predicted time that is imbalance (the padded kernel's padding rows).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from aserve.engine.sequence import IterationRecord
from bench.workloads import Workload, WorkloadRequest
from scheduler import ceil_div
from scheduler.cost_model import CostModel


@dataclass(frozen=True, slots=True)
class Bubble:
    """The padding of a run's decode steps."""

    padded_tokens: int  # KV tokens read beyond each seq's own (padded to the longest)
    real_tokens: int  # KV tokens of the seqs themselves
    imbalance_share: float  # of the steps' predicted time, the imbalance term's share
    num_steps: int

    @property
    def padded_per_step(self) -> float:
        return self.padded_tokens / self.num_steps if self.num_steps else math.nan


def decode_steps(iterations: Sequence[IterationRecord]) -> list[IterationRecord]:
    """The pure decode steps of decode instances (no prompt tokens mixed in)."""
    return [it for it in iterations
            if it.num_prefill_tokens == 0 and it.lengths and not it.instance.startswith(
                ("prefill", "probe"))]


def bubble(iterations: Sequence[IterationRecord], cost: CostModel) -> Bubble:
    """The padding of ``iterations``' decode steps, and the share of their predicted time
    (``cost``) that is the kernel's imbalance (``CostModel.lost_to_imbalance``)."""
    steps = decode_steps(iterations)
    padded = sum(len(it.lengths) * max(it.lengths) - sum(it.lengths) for it in steps)
    real = sum(sum(it.lengths) for it in steps)
    total = imbalance = 0.0
    for it in steps:
        total += cost.iteration_time(it.lengths)
        imbalance += cost.lost_to_imbalance(it.lengths)
    return Bubble(padded, real, imbalance / total if total else math.nan, len(steps))


def search_decode_time(workload: Workload, cost: CostModel, num_blocks: int,
                       block_size: int, max_batch_size: int) -> float:
    """The least decode time of a static schedule found by the search (module docstring)."""
    return min(_partition(sorted(workload.requests, key=key), cost, num_blocks, block_size,
                          max_batch_size)[0]
               for key in (lambda r: (r.prompt_len, r.output_len),
                           lambda r: (r.prompt_len + r.output_len, r.prompt_len)))


def output_blind_decode_time(workload: Workload, cost: CostModel, num_blocks: int,
                             block_size: int, max_batch_size: int) -> float:
    """The decode time of the search's schedule chosen without each request's output
    length: requests sorted by prompt length alone (ties in arrival order), the partition
    the dynamic program picks when every output is the workload's mean, then run with the
    real outputs. Blocks are still checked at each request's final length (its
    ``max_tokens``, which a server holds).

    A policy sees only each sequence's length so far, not how long it will run; this is
    the bound restricted to what such a policy could plan on, the prompts of the whole
    backlog and the outputs' mean. The gap to ``search_decode_time`` is what knowing
    each output is worth."""
    reqs = sorted(workload.requests, key=lambda r: r.prompt_len)
    if not reqs:
        return 0.0
    mean = round(sum(r.output_len for r in reqs) / len(reqs))
    _, cuts = _partition(reqs, cost, num_blocks, block_size, max_batch_size,
                         planned_outputs=[mean] * len(reqs))
    return sum(_batch_time(reqs[i:j], cost) for i, j in zip(cuts, cuts[1:], strict=False))


def _decode_lengths(req: WorkloadRequest) -> tuple[int, int]:
    """(length at its first decode step, number of decode steps): the prefill samples the
    first token, each decode step one more."""
    return req.prompt_len + 1, req.output_len - 1


def _batch_time(reqs: Sequence[WorkloadRequest], cost: CostModel) -> float:
    """Decode time of ``reqs`` as one batch run to completion."""
    first, steps = (np.array(x) for x in zip(*map(_decode_lengths, reqs), strict=True))
    k = np.arange(int(steps.max()))[:, None]
    active = k < steps[None, :]
    length = np.where(active, first[None, :] + k, 0)
    return float(cost.decode_step_times(active.sum(axis=1), length.sum(axis=1),
                                      length.max(axis=1)).sum())


def _partition(reqs: Sequence[WorkloadRequest], cost: CostModel, num_blocks: int,
               block_size: int, max_batch_size: int,
               planned_outputs: Sequence[int] | None = None) -> tuple[float, list[int]]:
    """Dynamic program: best[j] = min over i of best[i] + time(reqs[i:j] as one batch),
    costed with ``planned_outputs`` where given (else the real ones); returns the least
    time and the partition's cut points (0, ..., len(reqs))."""
    n = len(reqs)
    outputs = ([r.output_len for r in reqs] if planned_outputs is None
               else list(planned_outputs))
    first = np.array([_decode_lengths(r)[0] for r in reqs])
    steps = np.array([out - 1 for out in outputs])  # as _decode_lengths
    blocks = [ceil_div(r.prompt_len + r.output_len, block_size) for r in reqs]
    horizon = int(steps.max(initial=0))
    k = np.arange(horizon)
    best = [0.0] + [math.inf] * n
    back = [0] * (n + 1)
    for i in range(n):
        if math.isinf(best[i]):
            continue
        num = np.zeros(horizon)
        total = np.zeros(horizon)
        longest = np.zeros(horizon)
        held = 0
        for j in range(i, min(n, i + max_batch_size)):
            held += blocks[j]
            if held > num_blocks:
                break
            active = k < steps[j]
            length = first[j] + k
            num += active
            total += np.where(active, length, 0)
            longest = np.where(active, np.maximum(longest, length), longest)
            cand = best[i] + float(cost.decode_step_times(num, total, longest).sum())
            if cand < best[j + 1]:
                best[j + 1], back[j + 1] = cand, i
    cuts = [n]
    while cuts[-1] > 0:
        cuts.append(back[cuts[-1]])
    return best[n], cuts[::-1]


def ideal_decode_time(workload: Workload, cost: CostModel, num_blocks: int,
                      block_size: int, max_batch_size: int) -> float:
    """Every decode token at the per-token time of the largest batch of its own length the
    instance holds (``max_batch_size`` seqs, or as many as its blocks hold)."""
    total = 0.0
    for req in workload.requests:
        first, num = _decode_lengths(req)
        if num <= 0:
            continue
        length = first + np.arange(num)
        fits = np.maximum(1, np.minimum(max_batch_size,
                                        num_blocks // np.ceil(length / block_size)))
        per_token = cost.decode_step_times(fits, fits * length, length) / fits
        total += float(per_token.sum())
    return total
