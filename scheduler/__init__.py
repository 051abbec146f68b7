"""Pure scheduling policy for AlignedServe: quad-tree, density-first search, batch-level
scheduling and baseline policies. Imports no torch, no asyncio, reads no clock.
"""

from __future__ import annotations

from scheduler.aligned import AlignedNoPrefetchPolicy, AlignedPolicy
from scheduler.aligned_strict import AlignedLoosePolicy, AlignedStrictPolicy
from scheduler.batching import BoundaryPlan, BoundaryView, SeqView, ceil_div, tree_range
from scheduler.continuous import (
    ContinuousPlan,
    ContinuousPolicy,
    ContinuousScheduler,
    ContinuousSeq,
)
from scheduler.dfs import anchored_search, density_first_search
from scheduler.fcfs import FcfsPolicy
from scheduler.policy import (
    POLICIES,
    Policy,
    PolicyConfig,
    PolicyKnobs,
    get_policy,
    register_policy,
)
from scheduler.quadtree import PooledRequest, QuadNode, QuadTree
from scheduler.step_time import StepTime, mixing_pays, unit_step_time

__all__ = [
    "POLICIES",
    "AlignedLoosePolicy",
    "AlignedNoPrefetchPolicy",
    "AlignedPolicy",
    "AlignedStrictPolicy",
    "BoundaryPlan",
    "BoundaryView",
    "ContinuousPlan",
    "ContinuousPolicy",
    "ContinuousScheduler",
    "ContinuousSeq",
    "FcfsPolicy",
    "Policy",
    "PolicyConfig",
    "PolicyKnobs",
    "PooledRequest",
    "QuadNode",
    "QuadTree",
    "SeqView",
    "StepTime",
    "anchored_search",
    "ceil_div",
    "density_first_search",
    "get_policy",
    "mixing_pays",
    "register_policy",
    "tree_range",
    "unit_step_time",
]
