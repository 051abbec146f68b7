"""The event loop's lag, measured and watched: a heartbeat task on the loop and a watchdog
thread beside it. The server exports the lag as a metric; any loop iteration that holds the
loop longer than `threshold` is logged (WARNING) with the stack of what was running, taken
by the watchdog while it ran.

Nothing here knows the engine or HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable

logger = logging.getLogger(__name__)
BEAT_S = 0.02  # seconds between heartbeats (the lag's resolution)
THRESHOLD_S = 0.25  # a loop iteration longer than this is logged
STACK_FRAMES = 8  # innermost frames logged of what held the loop
LOOP_FILES = ("asyncio/runners.py", "asyncio/base_events.py", "selectors.py",
              "uvloop/__init__.py")  # uvloop runs its loop in C, under `run`
IN_THE_LOOP = ("  (no Python callback was running: the loop waited for the CPU or for the GIL, "
               "which a worker thread held)\n")


class LoopWatch:
    """Heartbeats on the running loop, each observing its lateness (`on_lag`, seconds);
    a watchdog thread that, while a heartbeat is overdue by `threshold`, takes the loop
    thread's stack; and, once the loop is back, one WARNING naming how long it was held
    and that stack."""

    def __init__(self, on_lag: Callable[[float], object] = lambda lag: None,
                 threshold: float = THRESHOLD_S, beat: float = BEAT_S) -> None:
        self.on_lag, self.threshold, self.beat = on_lag, threshold, beat
        self.num_stalls = 0  # loop iterations logged as over `threshold`
        self._last_beat = time.monotonic()
        self._stack: str | None = None  # what held the loop, taken by the watchdog
        self._stopped = threading.Event()
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Starts watching the running loop (call from it)."""
        loop_thread = threading.get_ident()
        self._last_beat = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._heartbeat(), name="loop-watch")
        self._thread = threading.Thread(target=self._watch, args=(loop_thread,),
                                        name="aserve-loop-watch", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopped.set()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    async def _heartbeat(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.beat
            await asyncio.sleep(self.beat)
            lag = max(0.0, loop.time() - due)
            self._last_beat = time.monotonic()
            self.on_lag(lag)
            if lag > self.threshold:
                self.num_stalls += 1
                stack, self._stack = self._stack, None
                logger.warning("the event loop was held for %.0f ms (over %.0f ms); it ran:\n%s",
                               1000 * lag, 1000 * self.threshold,
                               stack or "  (no stack taken: the watchdog thread was not run)")

    def _watch(self, loop_thread: int) -> None:
        """Takes the loop thread's stack once per stall, while it is held."""
        taken_for = None  # the heartbeat whose stall the stack belongs to
        while not self._stopped.wait(self.threshold / 2):
            last = self._last_beat
            if time.monotonic() - last > self.beat + self.threshold and taken_for != last:
                frame = sys._current_frames().get(loop_thread)
                if frame is not None:
                    stack = traceback.extract_stack(frame)
                    self._stack = "".join(traceback.format_list(stack[-STACK_FRAMES:]))
                    if stack[-1].filename.endswith(LOOP_FILES):  # in the loop's own code
                        self._stack += IN_THE_LOOP
                    taken_for = last
