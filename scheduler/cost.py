"""The step cost a cost-aware policy decides with: a function of one decode step's KV
lengths, given by the driver, never computed from torch here.

The functional form (weights, per-sequence overheads, and the attention work of the backend:
padded = batch x longest, per-sequence = waves over the device's workers, split-K/paged =
total work) lives in sim/cost.py (``CostModel.iteration_time``), one model for both
drivers: the simulator passes its cost model, the engine the same model with constants
fitted from its own iteration records (aserve/step_cost.py). Policies only compare the
numbers, so any unit works as long as one function gives them all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

StepTime = Callable[[Sequence[int]], float]  # KV lengths of one decode step -> seconds

UNIT_WEIGHTS_TOKENS = 4096  # the default's fixed part, in KV tokens read


def unit_step_time(lengths: Sequence[int]) -> float:
    """The default when a driver gives no cost: a paged (split-K) step that reads the
    weights (worth ``UNIT_WEIGHTS_TOKENS`` KV tokens) and every KV token once. Under it a
    larger batch always pays, as it does on a memory-bound device without imbalance."""
    return float(UNIT_WEIGHTS_TOKENS + sum(lengths))


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
