"""What the cores hand their drivers: KV moves and forward passes as data, the wiring
between instances (messages in the engine, calls in the simulator), and the policy's view
of a sequence."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

from aserve.core import Sequence
from scheduler import SeqView


@dataclass(frozen=True, slots=True)
class Move:
    """Copy `seq`'s KV from store `src` to store `dst` (the destination is already
    allocated); the driver copies, then calls the core's `landed` (or `failed`)."""

    seq: Sequence
    src: str
    dst: str
    num_blocks: int
    # a fork (n > 1): the parent's block ids to copy from, in the same store (`src == dst`)
    src_ids: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class Forward:
    """One forward pass: compute `num_new_tokens[i]` more tokens of `seqs[i]`."""

    instance: str
    seqs: list[Sequence]
    num_new_tokens: list[int]
    start_time: float  # when the core issued it (the driver's clock)

    @property
    def lengths(self) -> list[int]:
        """Prefix length of each seq once the step is done (tokens)."""
        return [s.num_computed_tokens + n for s, n in zip(self.seqs, self.num_new_tokens)]


class Window(NamedTuple):
    """A decode instance's running length window, for dynamic prefetch."""

    lo: int
    hi: int
    max_blocks: int  # decode room the instance can accept for matching requests
    max_requests: int


class Wiring(Protocol):
    """How one core reaches the others; each driver implements it (messages or calls)."""

    def pooled(self, seq: Sequence) -> None:
        """`seq`'s KV landed in the host pool: the batcher indexes it."""

    def want_batch(self, instance: int) -> None:
        """Decode instance `instance`'s candidate batch buffer is empty."""

    def report_window(self, instance: int, window: Window) -> None:
        """Decode instance `instance`'s running length window changed."""

    def deliver(self, instance: int, batch_id: int, seqs: list[Sequence]) -> None:
        """Staged seqs for decode instance `instance`: a candidate batch, or candidate
        requests when `batch_id` < 0."""

    def pool_space(self) -> None:
        """Host-pool blocks were freed: prefill held back by a full pool may go on."""

    def staging_space(self, instance: int) -> None:
        """Staging blocks of `instance` were freed: the batcher may stage more."""

    def recompute(self, seq: Sequence) -> None:
        """`seq` lost its KV (nowhere to keep it): prefill it again, first in line."""


def seq_view(seq: Sequence, num_blocks: int) -> SeqView:
    """The policy's view of a sequence holding `num_blocks` KV blocks; it has waited since
    its last token (the first comes from prefill), or since arrival before that."""
    return SeqView(seq.seq_id, seq.num_tokens, num_blocks, seq.request.arrival_time,
                   seq.batch_id, seq.token_times[-1] if seq.token_times else None,
                   seq.num_returns)
