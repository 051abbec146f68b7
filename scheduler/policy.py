"""Scheduling policy interface, its configuration, and the registry of policies by name.

A policy owns the pool-side choice of the next batch and the decisions at each decode
iteration boundary. Pure: time is passed in, nothing here reads a clock or does I/O.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import msgspec

from scheduler.batching import BoundaryPlan, BoundaryView, SeqView
from scheduler.step_time import StepTime, unit_step_time


class PolicyKnobs(msgspec.Struct, frozen=True, kw_only=True):
    """The knobs of the built-in policies: their one declaration, defaults and validation.
    The engine's SchedulerConfig (and through it the simulator's cluster and the CLI's
    options) inherits them."""

    min_requests: int = 8  # DFS: smallest batch that saturates the device (requests)
    leaf_width: int = 16  # quad-tree leaf range (tokens)
    starvation_threshold: float | None = 30.0  # seconds; None switches starvation control off
    match_slack: float = 0.25  # dynamic prefetch window widening (fraction of length)
    max_spread: float | None = 1.5  # aligned-strict: every admission keeps the running
    # batch's longest prefix within this many times its shortest (None: the paper's rules)
    drain_floor: float = 0.1  # aligned, aligned-strict: a switch waits for the old batch to
    # drain down to this share (aligned-strict: of max_batch_size; aligned: of the running
    # seqs and the candidate batch), then returns those left to the pool

    def __post_init__(self) -> None:
        for name in ("min_requests", "leaf_width"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} ({value}) must be >= 1")
        threshold = self.starvation_threshold
        if threshold is not None and threshold < 0:
            raise ValueError(f"starvation_threshold ({threshold}) must be >= 0 or None")
        if self.match_slack < 0:
            raise ValueError(f"match_slack ({self.match_slack}) must be >= 0")
        if self.max_spread is not None and self.max_spread < 1:
            raise ValueError(f"max_spread ({self.max_spread}) must be >= 1 or None")
        if not 0 <= self.drain_floor <= 1:
            raise ValueError(f"drain_floor ({self.drain_floor}) must be in [0, 1]")


class PolicyConfig(PolicyKnobs, frozen=True, kw_only=True):
    """What a policy is built with: the knobs, and the quad-tree's range of lengths."""

    max_len: int = 65536  # quad-tree range (tokens)

    @classmethod
    def of(cls, knobs: PolicyKnobs, max_len: int) -> PolicyConfig:
        """The policy knobs a config carries (the engine's SchedulerConfig, which the
        simulator's ClusterConfig holds too), with the tree's range."""
        names = (f.name for f in msgspec.structs.fields(PolicyKnobs))
        return cls(max_len=max_len, **{n: getattr(knobs, n) for n in names})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_len < 1:
            raise ValueError(f"max_len ({self.max_len}) must be >= 1")


# a waiting prompt that later arrivals have overtaken in this many prefills goes first
# (``Policy.prefills_shortest_first``): a finite backlog drains shortest first, and under a
# stream no prompt waits behind shorter ones for more than a few prefills
PREFILL_PASSES = 4
# a pacing policy (``Policy.prefill_quota``) lets at least this many prefilled requests
# wait for their first decode step
PREFILL_LEAD = 16


class Policy(ABC):
    """A scheduling policy, chosen once at start-up by name (see ``get_policy``).

    The engine tells the policy which requests enter and leave the host pool, asks it for
    the next candidate batch, and asks it for a plan at every decode iteration boundary.
    """

    name: ClassVar[str]
    uses_pool: ClassVar[bool] = True  # False: prefill and decode share a device, no pool
    uses_staging: ClassVar[bool] = True  # False: KV goes host -> decode device directly
    uses_dynamic_prefetch: ClassVar[bool] = False  # True: the engine should call matching()
    uses_step_cost: ClassVar[bool] = False  # True: decides with ``step_time`` (a driver
    # should give it a fitted model, e.g. the engine's start-up probe)

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        # the predicted time of one decode step over given KV lengths (scheduler/step_time.py),
        # set by ``get_policy``; a driver may replace it as its constants are refitted
        self.step_time: StepTime = unit_step_time
        # the lengths of the requests on their way to the pool (waiting for prefill,
        # prefilling, or prefilled and not yet pooled) on prefill instances whose
        # device also decodes: set by the driver's batcher before each ``next_batch``;
        # decode steps spent before they are pooled are that device's time, which the
        # prefills would use as well
        self.incoming: Sequence[int] = ()
        # the room of a batch the driver's batcher asks ``next_batch`` for first
        # (max_blocks, max_requests), set once it is known
        self.batch_room: tuple[int, int] | None = None

    def prefills_shortest_first(self) -> bool:
        """Whether a prefill instance whose device also decodes should take its waiting
        prompts shortest first (one overtaken by later arrivals in ``PREFILL_PASSES``
        prefills goes first), so that the pool holds a backlog's shortest requests first;
        else in arrival order. Asked before each such prefill."""
        return False

    def prefill_quota(self, num_unstarted: int, running: Sequence[int],
                      waiting: Sequence[tuple[int, int, float]]) -> int:
        """How many of the ``waiting`` prompts a prefill instance whose device also decodes
        and that prefills shortest first (``prefills_shortest_first``) may prefill now, in
        the order it takes them (0 holds the prefill back), with ``num_unstarted``
        requests prefilled and waiting for their first decode step (their second token)
        and ``running`` the lengths of the seqs in the decode instances' running batches;
        ``waiting`` holds each prompt's length and KV blocks once prefilled (with its first
        token, as the pool would hold it) and its arrival.
        Asked again at each decode boundary and once one of those requests gets its second
        token. All by default: a backlog is prefilled as fast as the pool takes it."""
        return len(waiting)

    @abstractmethod
    def add(self, seq: SeqView) -> None:
        """A request entered the host pool. Raises ValueError if it is already there."""

    @abstractmethod
    def remove(self, seq_id: str) -> None:
        """A request left the pool (prefetched, aborted). Raises KeyError if unknown."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of pooled requests."""

    @abstractmethod
    def __contains__(self, seq_id: object) -> bool:
        """Whether ``seq_id`` is pooled."""

    @abstractmethod
    def next_batch(self, max_blocks: int, max_requests: int, now: float) -> list[str]:
        """Choose the next candidate batch from the pool; does not remove it.

        Args:
            max_blocks: KV blocks the batch may hold (sum of the chosen num_blocks).
            max_requests: requests the batch may hold.
            now: current time in seconds, on the clock of the arrival times.
        Returns:
            Pooled seq ids; the engine calls ``remove`` for each one it takes.
        """

    def matching(self, lo: int, hi: int, max_blocks: int, max_requests: int,
                 now: float) -> list[str]:
        """Dynamic prefetch: pooled requests with ``lo <= length <= hi``; none by default.
        ``now`` (seconds, the clock of the arrival times) lets a policy hold back for a
        starving request."""
        return []

    def matching_share(self, running: Sequence[Sequence[int]], instance: int) -> float:
        """The share of its window's room that decode instance ``instance`` may fill with
        ``matching`` requests, given the running lengths of every decode instance
        (``running[i]``; empty: idle or offline). 1 (the default): all of it."""
        return 1.0

    def prefetch_basis(self, current: Sequence[int], running: Sequence[int]) -> Sequence[int]:
        """The lengths ``prefetch_window`` is taken over, given those of the current batch
        and of every running seq: the current batch's (the old batch would widen it), or
        every running seq's under strict alignment, whose window bounds them all. Empty:
        no window to report."""
        return current if self.config.max_spread is None else running

    def prefetch_window(self, lengths: Sequence[int]) -> tuple[int, int]:
        """The ``(lo, hi)`` to pass to ``matching`` for a running batch of ``lengths``.

        The batch's length range widened by ``match_slack`` on both sides. With
        ``max_spread`` (strict alignment), the lengths a request may have to join without
        the batch's longest exceeding ``max_spread`` times its shortest,
        ``[longest / max_spread, shortest * max_spread]``, empty (``lo > hi``) for a batch
        already wider than that.

        NOTE: the widened range grows with every request it lets in (newcomers at its edges
        widen the next window), so a batch formed early from a small pool can stay wide for
        a whole run; the spread bound cannot grow (see tests/cores/test_alignment.py).
        """
        if not lengths:
            return 0, -1
        spread = self.config.max_spread
        if spread is None:
            slack = self.config.match_slack
            return int(min(lengths) * (1.0 - slack)), int(max(lengths) * (1.0 + slack))
        if max(lengths) > spread * min(lengths):
            return 0, -1
        return math.ceil(max(lengths) / spread), math.floor(min(lengths) * spread)

    @abstractmethod
    def plan_boundary(self, view: BoundaryView) -> BoundaryPlan:
        """Decide evictions and admissions at one decode iteration boundary."""


POLICIES: dict[str, type[Policy]] = {}


def register_policy(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make ``cls`` available to ``get_policy`` under ``cls.name``.

    Raises ValueError if the class has no name or the name is taken by another class.
    """
    name = getattr(cls, "name", "")
    if not isinstance(name, str) or not name:
        raise ValueError(f"policy class {cls.__qualname__} must set a non-empty `name`")
    existing = POLICIES.get(name)
    if existing is not None and existing is not cls:
        raise ValueError(f"policy name {name!r} is already registered by "
                         f"{existing.__qualname__}")
    POLICIES[name] = cls
    return cls


def get_policy(name: str, config: PolicyConfig, step_time: StepTime | None = None) -> Policy:
    """Instantiate the policy registered as ``name``, deciding with ``step_time`` (the
    driver's step-cost model; None: ``unit_step_time``). Raises ValueError if unknown."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; known policies: {sorted(POLICIES)}")
    policy = cls(config)
    if step_time is not None:
        policy.step_time = step_time
    return policy
