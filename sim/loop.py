"""The simulator's machinery: a heapq event loop, simulated links and devices.

Pure bookkeeping on a simulated clock; no scheduling (that is `aserve.cores` and
`scheduler/`), no costs (that is `sim.cost`). Events at the same time run in the order they
were scheduled.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

Callback = Callable[[], None]


class EventLoop:
    """A simulated clock and a heap of callbacks ordered by (time, scheduling order)."""

    def __init__(self) -> None:
        self.now = 0.0  # simulated seconds
        self.num_events = 0  # callbacks run so far
        self._heap: list[tuple[float, int, Callback]] = []
        self._counter = itertools.count()

    def at(self, time: float, callback: Callback) -> None:
        """Runs `callback` at `time`. Raises ValueError for a time in the past."""
        if time < self.now:
            raise ValueError(f"time ({time}) must be >= now ({self.now})")
        heapq.heappush(self._heap, (time, next(self._counter), callback))

    def soon(self, callback: Callback) -> None:
        """Runs `callback` at the current time, after what is already due now."""
        self.at(self.now, callback)

    def run(self, until: float = float("inf"), max_events: int | None = None) -> None:
        """Runs callbacks in order until the heap is empty, the next is after `until`, or
        `max_events` callbacks have run in all (None: no cap)."""
        heap = self._heap
        cap = float("inf") if max_events is None else max_events
        while heap and heap[0][0] <= until and self.num_events < cap:
            time, _, callback = heapq.heappop(heap)
            self.now = time
            self.num_events += 1
            callback()

    def __len__(self) -> int:
        return len(self._heap)


class Link:
    """One direction of one link: transfers queue behind each other (FIFO) on its own
    timeline, or with `device` on that device's compute timeline (the engine on a CPU
    copies between CPU stores in the device's worker thread, between its forwards).
    """

    __slots__ = ("bandwidth", "timeline")

    def __init__(self, name: str, bandwidth: float, device: Device | None = None) -> None:
        if not bandwidth > 0:
            raise ValueError(f"bandwidth ({bandwidth}) of link {name!r} must be > 0")
        self.bandwidth, self.timeline = bandwidth, device or Device(name)

    def transfer(self, start: float, num_bytes: float) -> float:
        """Queues `num_bytes` no earlier than `start`; returns when they have arrived."""
        return self.timeline.run(start, num_bytes / self.bandwidth)[1]


class Device:
    """A compute timeline: instances on one device run their steps one after another (a
    link's own timeline too)."""

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
