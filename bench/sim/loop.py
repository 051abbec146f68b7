"""The simulator's machinery: a heapq event loop, sequences, KV stores, links and devices.

Pure bookkeeping on a simulated clock; no policy (that is `scheduler/`), no costs (that is
`bench.sim.cost`). Events at the same time run in the order they were scheduled.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from aserve.core import Event, EventKind, IterationRecord

Callback = Callable[[], None]

# Sequence states, in life order (the engine's SeqStatus, minus the finished variants).
WAITING, PREFILLING, POOLED, STAGED, DECODING, FINISHED = range(6)


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

    def run(self, until: float = float("inf")) -> None:
        """Runs callbacks in order until the heap is empty or the next is after `until`."""
        heap = self._heap
        while heap and heap[0][0] <= until:
            time, _, callback = heapq.heappop(heap)
            self.now = time
            self.num_events += 1
            callback()

    def __len__(self) -> int:
        return len(self._heap)


class SimActor:
    """An actor on the simulated clock: `wake()` is a message arriving, `act()` its handler.

    A woken actor acts once the current callback ends, unless it is busy; a busy actor acts
    again when its work is done (`finish_at`, or its own completion callback).
    """

    def __init__(self, loop: EventLoop) -> None:
        self.loop = loop
        self.is_busy = False
        self._is_woken = False

    def wake(self) -> None:
        if not self._is_woken and not self.is_busy:
            self._is_woken = True
            self.loop.soon(self._on_wake)

    def act(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement act()")

    def finish_at(self, time: float) -> None:
        """Busy until `time`, then act again."""
        self.is_busy = True
        self.loop.at(time, self._on_finish)

    def _on_wake(self) -> None:
        self._is_woken = False
        if not self.is_busy:
            self.act()

    def _on_finish(self) -> None:
        self.is_busy = False
        self.act()


class SimSeq:
    """One request's state in the simulator (the engine's `Sequence`, lengths only)."""

    __slots__ = ("seq_id", "prompt_len", "output_len", "arrival_time", "num_tokens",
                 "num_computed", "num_output", "num_blocks", "location", "instance",
                 "batch_id", "status", "last_token_time")

    def __init__(self, seq_id: str, prompt_len: int, output_len: int,
                 arrival_time: float) -> None:
        self.seq_id = seq_id
        self.prompt_len = prompt_len
        self.output_len = output_len  # tokens to generate (the request stops after them)
        self.arrival_time = arrival_time
        self.num_tokens = prompt_len  # prompt + generated
        self.num_computed = 0  # tokens whose KV exists
        self.num_output = 0
        self.num_blocks = 0  # blocks held in `location`
        self.location: Store | None = None
        self.instance = -1
        self.batch_id = -1
        self.status = WAITING
        self.last_token_time: float | None = None  # starvation control's clock (None: arrival)

    def __repr__(self) -> str:
        where = self.location.name if self.location else "-"
        return f"SimSeq({self.seq_id}, tokens={self.num_tokens}, at={where})"


class Store:
    """A KV store's block count (the engine's KVStore, capacity only)."""

    __slots__ = ("name", "kind", "num_blocks", "num_free", "_usage")

    def __init__(self, name: str, kind: str, num_blocks: int, usage: dict[str, int]) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks ({num_blocks}) of store {name!r} must be >= 0")
        self.name, self.kind = name, kind
        self.num_blocks = self.num_free = num_blocks
        self._usage = usage  # shared: blocks in use per kind of store

    def _take(self, num_blocks: int) -> None:
        self.num_free -= num_blocks
        self._usage[self.kind] += num_blocks


class Stores:
    """Every KV store by name, with block arithmetic on sequences."""

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size ({block_size}) must be >= 1")
        self.block_size = block_size
        self.usage: dict[str, int] = {"prefill": 0, "staging": 0, "host": 0, "decode": 0}
        self.by_name: dict[str, Store] = {}

    def add(self, name: str, kind: str, num_blocks: int) -> Store:
        store = Store(name, kind, num_blocks, self.usage)
        self.by_name[name] = store
        return store

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, seq: SimSeq, store: Store, num_tokens: int) -> bool:
        """Gives `seq` blocks for `num_tokens` in `store`; False (no change) when full."""
        assert seq.location is None, f"{seq.seq_id} already holds KV in {seq.location}"
        need = self.blocks_for(num_tokens)
        if need > store.num_free:
            return False
        store._take(need)
        seq.location, seq.num_blocks = store, need
        return True

    def grow(self, seq: SimSeq, num_tokens: int) -> bool:
        """Extends `seq`'s blocks in place to cover `num_tokens`; False when full."""
        store = seq.location
        assert store is not None, f"{seq.seq_id} holds no KV"
        need = self.blocks_for(num_tokens) - seq.num_blocks
        if need <= 0:
            return True
        if need > store.num_free:
            return False
        store._take(need)
        seq.num_blocks += need
        return True

    def release(self, seq: SimSeq) -> None:
        """Frees every block `seq` holds; a no-op when it holds none."""
        if seq.location is not None:
            seq.location._take(-seq.num_blocks)
            seq.location, seq.num_blocks = None, 0

    def retire(self, running: list[SimSeq], finished: list[SimSeq]) -> list[SimSeq]:
        """Frees the KV of `finished` seqs; returns `running` without them."""
        if not finished:
            return running
        for seq in finished:
            self.release(seq)
        return [s for s in running if s.status != FINISHED]

    def move(self, seq: SimSeq, dst: Store) -> int:
        """Moves `seq`'s KV (num_computed tokens) to `dst`: blocks moved, 0 when `dst` is full."""
        need = self.blocks_for(max(seq.num_computed, 1))
        if need > dst.num_free:
            return 0
        self.release(seq)
        dst._take(need)
        seq.location, seq.num_blocks = dst, need
        return need

    def used(self) -> dict[str, int]:
        return dict(self.usage)


class Link:
    """One direction of one link: transfers queue behind each other (FIFO).

    With `device`, the copies run on that device's compute timeline instead (the engine on
    a CPU copies between CPU stores in the device's worker thread, between its forwards).
    """

    __slots__ = ("name", "bandwidth", "busy_until", "num_bytes", "device")

    def __init__(self, name: str, bandwidth: float, device: Device | None = None) -> None:
        if not bandwidth > 0:
            raise ValueError(f"bandwidth ({bandwidth}) of link {name!r} must be > 0")
        self.name, self.bandwidth, self.device = name, bandwidth, device
        self.busy_until = 0.0
        self.num_bytes = 0.0  # moved so far

    def transfer(self, start: float, num_bytes: float) -> float:
        """Queues `num_bytes` no earlier than `start`; returns when they have arrived."""
        self.num_bytes += num_bytes
        if self.device is not None:
            self.busy_until = self.device.run(start, num_bytes / self.bandwidth)[1]
            return self.busy_until
        begin = max(start, self.busy_until)
        self.busy_until = begin + num_bytes / self.bandwidth
        return self.busy_until


class Device:
    """A compute timeline: instances on one device run their steps one after another."""

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


class Recorder:
    """The lifecycle events and iteration records a run produces (what the benchmark reads)."""

    def __init__(self, record_tokens: bool = True) -> None:
        self.events: list[Event] = []
        self.iterations: list[IterationRecord] = []
        self.record_tokens = record_tokens  # one "token" event per token (for TPOT)
        self.num_finished = 0

    def event(self, seq: SimSeq, kind: EventKind, time: float) -> None:
        self.events.append(Event(seq.seq_id, kind, time))

    def token(self, seq: SimSeq, time: float) -> bool:
        """Records one generated token; returns True (and records the finish) when it was
        the last one the request asked for."""
        seq.num_tokens += 1
        seq.num_output += 1
        seq.last_token_time = time
        if seq.num_output == 1:
            self.events.append(Event(seq.seq_id, "first_token", time))
        elif self.record_tokens:
            self.events.append(Event(seq.seq_id, "token", time))
        if seq.num_output < seq.output_len:
            return False
        seq.status = FINISHED
        self.num_finished += 1
        self.events.append(Event(seq.seq_id, "finish", time))
        return True
