"""Choosing between ways of computing the same product by timing them where they run.

Which GEMM, or which split of one, is fastest depends on the CPU, the library's version and
the thread count, so the kernels that choose (`models.row_blocks`, `models.opt`'s float32
linear) time their candidates on first use instead of carrying a table.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TypeVar

T = TypeVar("T")


def timed(way: Callable[[], T]) -> tuple[float, T]:
    """Wall seconds of one call of ``way``, and its result."""
    start = time.perf_counter()
    result = way()
    return time.perf_counter() - start, result


def best_seconds(ways: Mapping[str, Callable[[], T]], trials: int
                 ) -> tuple[dict[str, float], dict[str, T]]:
    """The fastest of ``trials`` timed calls of each way, the ways called in turn within a
    trial (so that the machine's drift falls on all of them), and each way's last result."""
    best = dict.fromkeys(ways, float("inf"))
    results: dict[str, T] = {}
    for _ in range(trials):
        for name, way in ways.items():
            spent, results[name] = timed(way)
            best[name] = min(best[name], spent)
    return best, results
