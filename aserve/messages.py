"""The msgspec messages that actors send each other.

A message that carries a `Sequence` hands it over: the sender must not touch it afterwards.
Messages never carry tensors.
"""

from __future__ import annotations

import msgspec

from aserve.core import Sequence
from aserve.cores import Window


class Submit(msgspec.Struct, frozen=True):
    """A new (or recompute-preempted) sequence for prefill; `front` puts it first in line."""

    seq: Sequence
    front: bool = False


class Pooled(msgspec.Struct, frozen=True):
    """A sequence whose KV now sits in the host pool."""

    seq: Sequence


class Wake(msgspec.Struct, frozen=True):
    """Room was freed (host pool or staging): a waiting actor may go on."""


class WantBatch(msgspec.Struct, frozen=True):
    """A decode instance's candidate batch buffer is empty."""

    instance: int


class RunningWindow(msgspec.Struct, frozen=True):
    """A decode instance's running prefix-length window, for dynamic prefetch."""

    instance: int
    window: Window


class Deliver(msgspec.Struct, frozen=True):
    """Batcher -> decode: the next candidate batch, or candidate requests (batch_id < 0)."""

    batch_id: int
    seqs: list[Sequence]


class Stop(msgspec.Struct, frozen=True):
    """Ends an actor's run loop."""


Message = Submit | Pooled | Wake | WantBatch | RunningWindow | Deliver | Stop
