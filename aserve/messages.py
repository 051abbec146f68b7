"""The msgspec messages that actors send each other.

A message that carries a `Sequence` hands it over: the sender must not touch it afterwards.
Messages never carry tensors.
"""

from __future__ import annotations

import asyncio

import msgspec

from aserve.core import Sequence


class Submit(msgspec.Struct, frozen=True):
    """A new (or recompute-preempted) sequence for prefill; `front` puts it first in line."""

    seq: Sequence
    front: bool = False


class Pooled(msgspec.Struct, frozen=True):
    """A sequence whose KV now sits in the host pool."""

    seq: Sequence


class Abort(msgspec.Struct, frozen=True):
    """End a request wherever it is; every actor that owns it frees its blocks."""

    seq_id: str


class PoolSpace(msgspec.Struct, frozen=True):
    """Host-pool blocks were freed; a prefill actor waiting on backpressure may go on."""


class PoolChanged(msgspec.Struct, frozen=True):
    """The pool gained requests; the batcher may be able to serve a waiting instance."""


class WantBatch(msgspec.Struct, frozen=True):
    """A decode instance's candidate batch buffer is empty."""

    instance: int


class RunningWindow(msgspec.Struct, frozen=True):
    """A decode instance's running prefix-length range, for dynamic prefetch."""

    instance: int
    lo: int
    hi: int
    max_blocks: int  # staging room the instance can accept for matching requests
    max_requests: int


class TakeBatch(msgspec.Struct, frozen=True):
    """Batcher -> pool: remove the policy's next batch and hand its sequences over."""

    max_blocks: int
    max_requests: int
    reply: asyncio.Future[list[Sequence]]


class TakeMatching(msgspec.Struct, frozen=True):
    """Batcher -> pool: remove pool requests whose length lies in [lo, hi]."""

    lo: int
    hi: int
    max_blocks: int
    max_requests: int
    reply: asyncio.Future[list[Sequence]]


class CandidateBatch(msgspec.Struct, frozen=True):
    """Batcher -> decode: the next batch, staged (or still in the host pool without staging)."""

    batch_id: int
    seqs: list[Sequence]


class CandidateRequests(msgspec.Struct, frozen=True):
    """Batcher -> decode: single requests staged because they match the running batch."""

    seqs: list[Sequence]


class Stop(msgspec.Struct, frozen=True):
    """Ends an actor's run loop."""


Message = (
    Submit | Pooled | Abort | PoolSpace | PoolChanged | WantBatch | RunningWindow | TakeBatch
    | TakeMatching | CandidateBatch | CandidateRequests | Stop
)
