"""Completion handle of an asynchronous KV block copy: an event to wait on or query, and
callbacks that run exactly once when completion is first observed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


class CopyHandle:
    """Completion of one block copy.

    On CUDA, `done_event` is recorded on the copy stream after the last write; on the CPU the
    copy finished before the handle was returned. Completion callbacks (a deferred host-side
    scatter, freeing the source blocks of a `move`) run exactly once, on the first `wait()` or
    `done()` that observes completion, so a caller must call one of them until it is done.
    """

    def __init__(
        self,
        nbytes: int,
        num_blocks: int,
        start_time: float,
        done_event: torch.cuda.Event | None = None,
        start_event: torch.cuda.Event | None = None,
    ) -> None:
        self.nbytes = nbytes  # bytes copied
        self.num_blocks = num_blocks  # blocks copied
        self.start_time = start_time  # perf_counter() when the copy was issued
        # perf_counter() when the copy ended (CPU) or its completion was first observed (CUDA)
        self.end_time: float | None = None
        self._done_event = done_event
        self._start_event = start_event
        self._callbacks: list[Callable[[], None]] = []
        self._keep_alive: list[torch.Tensor] = []  # staging tensors in flight
        self.is_finished = False

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        """Runs `callback` once when completion is first observed (by `wait` or `done`)."""
        if self.is_finished:
            callback()
        else:
            self._callbacks.append(callback)

    def keep_alive(self, *tensors: torch.Tensor) -> None:
        """Holds staging tensors until the copy completes."""
        self._keep_alive.extend(tensors)

    def wait(self) -> None:
        """Blocks the host until the copy is done, then runs the completion callbacks."""
        if self._done_event is not None:
            self._done_event.synchronize()
        self._finish()

    def done(self) -> bool:
        """Whether the copy is done (non-blocking); runs the completion callbacks when it is."""
        if self._done_event is not None and not self._done_event.query():
            return False
        self._finish()
        return True

    def fence(self, stream: torch.cuda.Stream) -> None:
        """Makes `stream` (e.g. the consumer's compute stream) wait for the copy without
        blocking the host. A deferred host scatter still needs `wait()` or `done()`."""
        if self._done_event is not None:
            stream.wait_event(self._done_event)

    @property
    def elapsed_time(self) -> float | None:
        """Seconds the copy took: device time between events on CUDA, host time on the CPU;
        None until completion has been observed."""
        if not self.is_finished or self.end_time is None:
            return None
        if self._start_event is not None and self._done_event is not None:
            return self._start_event.elapsed_time(self._done_event) / 1000.0
        return self.end_time - self.start_time

    def _finish(self) -> None:
        if self.is_finished:
            return
        self.is_finished = True
        if self.end_time is None:
            self.end_time = time.perf_counter()
        self._keep_alive.clear()
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()
