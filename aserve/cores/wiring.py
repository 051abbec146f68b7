"""How the cores of one engine (or one simulated cluster) reach one another."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from aserve.cores.base import BatcherMessage, Core
from aserve.cores.batcher import BatcherCore
from aserve.cores.colocated import ColocatedCore
from aserve.cores.decode import DecodeCore
from aserve.cores.prefill import PrefillCore
from aserve.engine.sequence import SeqState


class Driver(Protocol):
    """What the wiring needs of an instance's driver (an asyncio actor, a simulated
    instance): its core, and a way to wake it (it acts on the core's new state once free)."""

    core: Any

    def wake(self) -> None: ...


class Wiring:
    """How the cores of one engine (or one simulated cluster) reach one another, for both
    drivers: each call updates the receiving core at once and wakes its driver."""

    def __init__(self) -> None:
        self.prefills: list[Driver] = []  # drivers of PrefillCores
        self.batcher: Driver | None = None  # the BatcherCore's (disaggregated policies)
        self.decodes: list[Driver] = []  # drivers of DecodeCores, or of ColocatedCores
        self._held: dict[int, bool] = {}  # prefill instance -> its hold, last looked at

    @property
    def drivers(self) -> list[Driver]:
        return [*self.prefills, *filter(None, [self.batcher]), *self.decodes]

    def to_batcher(self, message: BatcherMessage) -> None:
        """Hands the batcher's core `message` at once and wakes its driver."""
        assert self.batcher is not None, "the disaggregated cluster has a batcher"
        self.batcher.core.receive(message)
        self.batcher.wake()

    def connect(self, drive: Callable[[Core, str | None], Driver], ctx: Any,
                decode_devices: Sequence[str]) -> None:
        """Builds the cores of `ctx.policy` (one colocated instance per decode device if it
        uses no pool; else prefill instances, the batcher and decode instances) over the
        driver's context `ctx` (see `Core`; its `config` is the engine's EngineConfig or the
        simulator's cluster, which names the prefill devices), each in its driver
        `drive(core, device)` (no device for the batcher), and starts them (the batcher is
        woken for the decode instances' first batches)."""
        pool = ctx.policy.uses_pool
        if pool:
            self.prefills = [drive(PrefillCore(ctx, i), dev)
                             for i, dev in enumerate(ctx.config.prefill_devices)]
            self.batcher = drive(BatcherCore(ctx), None)
            ctx.life.on_started = self.started
        core = DecodeCore if pool else ColocatedCore
        self.decodes = [drive(core(ctx, j), dev) for j, dev in enumerate(decode_devices)]
        if self.batcher is not None:
            self.batcher.wake()  # every decode instance starts out wanting a batch

    def submit(self, seq: SeqState, front: bool = False) -> None:
        """A new request (or one to prefill again, `front` first in line) goes to the
        entry instance with the fewest waiting tokens (prefill, or colocated) among those
        online, if any is."""
        entry = self.prefills or self.decodes
        entry = [driver for driver in entry if not driver.core.is_offline] or entry
        target = min(entry, key=lambda driver: sum(s.num_tokens for s in driver.core.waiting))
        target.core.submit(seq, front)
        target.wake()

    def reap(self, now: float) -> None:
        """An abort was asked: idle holders end the request now, the others at their next
        step (`Lifecycle.abort`)."""
        for driver in self.drivers:
            driver.core.reap(now)

    def deliver(self, instance: int, batch_id: int, seqs: list[SeqState]) -> None:
        """Staged seqs for decode instance `instance`: a candidate batch, or candidate
        requests when `batch_id` < 0."""
        self.decodes[instance].core.receive(batch_id, seqs)
        self.decodes[instance].wake()

    def started(self) -> None:
        """A prefilled request got its second token (or ended): a prefill the policy held
        back (`Policy.prefill_quota`) may go on."""
        for prefill in self.prefills:
            if prefill.core.waiting:
                prefill.wake()
        self.holds_may_change()

    def holds_may_change(self) -> None:
        """What a prefill's hold (`Policy.prefill_quota`) weighs may have changed: the
        decode instances' running seqs (asked at each of their boundaries and admissions,
        and once the last ones ended) or the prefilled requests waiting for their second
        token (asked when one starts, and seen at the next boundary when one is prefilled).
        Where the hold turned on or off, the prefill looks again, and so does the batcher,
        whose policy may wait for the prompts a prefill that is not held brings
        (`Policy.incoming`).

        NOTE: liveness. Seqs admitted to a decode instance that are not among the waiting
        requests (evicted ones coming back) lift a hold without any request starting; the
        prefill, asleep, never prefilled the prompts the batcher then waited for, and both
        waited for each other once the decode instance had drained."""
        for i, prefill in enumerate(self.prefills):
            if not prefill.core.waiting:
                continue
            held = prefill.core.held()
            if held != self._held.get(i):
                self._held[i] = held
                prefill.wake()
                if self.batcher is not None:
                    self.batcher.wake()

    def pool_space(self) -> None:
        """Host-pool blocks were freed: prefill held back by a full pool may go on."""
        for prefill in self.prefills:
            if prefill.core.blocked:
                prefill.wake()


