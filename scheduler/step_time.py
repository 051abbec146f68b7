"""The step cost a cost-aware policy decides with: a function of one decode step's KV
lengths, given by the driver, never computed from torch here.

The functional form (weights, per-sequence overheads, and the attention work of the backend:
padded = batch x longest, per-sequence = waves over the device's workers, split-K/paged =
total work) lives in scheduler/cost_model.py (``CostModel.iteration_time``), one model for both
drivers: the simulator passes its cost model, the engine the same model with constants
fitted from its own iteration records (aserve/engine/step_probe.py). Policies only compare the
numbers, so any unit works as long as one function gives them all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from scheduler.cost_model import VECTORISED_KERNELS

StepTime = Callable[[Sequence[int]], float]  # KV lengths of one decode step -> seconds

UNIT_WEIGHTS_TOKENS = 4096  # the default's fixed part, in KV tokens read


def unit_step_time(lengths: Sequence[int]) -> float:
    """The default when a driver gives no cost: a paged (split-K) step that reads the
    weights (worth ``UNIT_WEIGHTS_TOKENS`` KV tokens) and every KV token once. Under it a
    larger batch always pays, as it does on a memory-bound device without imbalance."""
    return float(UNIT_WEIGHTS_TOKENS + sum(lengths))


class GrowingStep(Protocol):
    """A decode step's predicted time as its batch grows one seq at a time."""

    def time(self) -> float:
        """The step over the batch as it stands."""
        ...

    def time_with(self, length: int) -> float:
        """The step were a seq of ``length`` tokens to join (nothing changes)."""
        ...

    def add(self, length: int) -> None:
        """A seq of ``length`` tokens joins (at the end of the batch)."""
        ...


class RecomputedStep:
    """``GrowingStep`` for any step-time function: each question costs the whole batch."""

    def __init__(self, step_time: StepTime, lengths: Sequence[int]) -> None:
        self.step_time, self.lengths = step_time, list(lengths)

    def time(self) -> float:
        return self.step_time(self.lengths)

    def time_with(self, length: int) -> float:
        return self.step_time([*self.lengths, length])

    def add(self, length: int) -> None:
        self.lengths.append(length)


RunTimes = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


def run_times(step_time: StepTime) -> RunTimes | None:
    """The model's vectorised form where it offers one for its kernel: a
    ``decode_step_times(num, total, longest)`` method (on ``step_time``, or on the object
    whose bound method it is, as scheduler/cost_model.py's ``CostModel.iteration_time``)
    giving the steps of ``num`` seqs holding ``total`` KV tokens, the longest ``longest``,
    as ``step_time`` would; else None."""
    owner = step_time if hasattr(step_time, "decode_step_times") else getattr(
        step_time, "__self__", None)
    times = getattr(owner, "decode_step_times", None)
    if times is None or getattr(owner, "kernel", None) not in VECTORISED_KERNELS:
        return None
    return times


def growing_step(step_time: StepTime, lengths: Sequence[int],
                 recompute: StepTime | None = None) -> GrowingStep:
    """The step over ``lengths`` as a batch that grows one seq at a time: the model's own
    incremental form where it offers one (a ``decode_step(lengths)`` method on
    ``step_time``, or on the object whose bound method it is, as scheduler/cost_model.py's
    ``CostModel.iteration_time``), which must give the very numbers ``step_time`` gives;
    otherwise ``RecomputedStep`` through ``recompute`` (default: ``step_time``)."""
    decode_step = getattr(step_time, "decode_step", None)
    if decode_step is None:
        decode_step = getattr(getattr(step_time, "__self__", None), "decode_step", None)
    if decode_step is not None:
        return decode_step(lengths)
    return RecomputedStep(step_time if recompute is None else recompute, lengths)


def tokens_per_second(step_time: StepTime, lengths: Sequence[int]) -> float:
    """Predicted decode throughput of a step over ``lengths`` (0 for an empty step)."""
    if not lengths:
        return 0.0
    return len(lengths) / max(step_time(lengths), 1e-12)


def mixing_pays(step_time: StepTime, first: Sequence[int], second: Sequence[int]) -> bool:
    """Whether one step over both groups is predicted no slower than a step of each: a
    batch and what would join it are better run together than apart."""
    if not first or not second:
        return True
    both = [*first, *second]
    return step_time(both) <= step_time(first) + step_time(second)
