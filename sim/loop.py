"""The simulator's machinery: a heapq event loop, and the timelines of simulated devices
and links.

Pure bookkeeping on a simulated clock; no scheduling (that is `aserve.cores` and
`scheduler/`), no costs (that is `scheduler.cost_model`). Events at the same time run in
the order they were scheduled, except those scheduled to run once the instant has settled
(`settled`), which run after every other event of their time.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

Callback = Callable[[], None]


class EventLoop:
    """A simulated clock and a heap of callbacks ordered by (time, settled last,
    scheduling order)."""

    def __init__(self) -> None:
        self.now = 0.0  # simulated seconds
        self.num_events = 0  # callbacks run so far
        self._heap: list[tuple[float, bool, int, Callback]] = []
        self._counter = itertools.count()

    def at(self, time: float, callback: Callback, settled: bool = False) -> None:
        """Runs `callback` at `time`; with `settled`, after every other callback due then
        (those scheduled meanwhile included). Raises ValueError for a time in the past."""
        if time < self.now:
            raise ValueError(f"time ({time}) must be >= now ({self.now})")
        heapq.heappush(self._heap, (time, settled, next(self._counter), callback))

    def soon(self, callback: Callback) -> None:
        """Runs `callback` at the current time, after what is already due now."""
        self.at(self.now, callback)

    def run(self, until: float = float("inf"), max_events: int | None = None) -> None:
        """Runs callbacks in order until the heap is empty, the next is after `until`, or
        `max_events` callbacks have run in all (None: no cap)."""
        heap = self._heap
        cap = float("inf") if max_events is None else max_events
        while heap and heap[0][0] <= until and self.num_events < cap:
            time, _, _, callback = heapq.heappop(heap)
            self.now = time
            self.num_events += 1
            callback()

    def __len__(self) -> int:
        return len(self._heap)


class Device:
    """A compute timeline: instances on one device run their steps one after another (one
    direction of a link too: its copies queue behind each other)."""

    __slots__ = ("name", "busy_until", "busy_time")

    def __init__(self, name: str) -> None:
        self.name = name
        self.busy_until = 0.0
        self.busy_time = 0.0  # seconds of compute so far

    def run(self, start: float, duration: float) -> tuple[float, float]:
        """Books `duration` seconds no earlier than `start`; returns (begin, end)."""
        begin = max(start, self.busy_until)
        self.busy_until = begin + duration
        self.busy_time += duration
        return begin, self.busy_until
