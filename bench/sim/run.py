"""Run one workload through one policy on a simulated cluster; the result holds the same
lifecycle events and iteration records as an engine run, so bench.metrics applies as is.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

from aserve.core import Event, IterationRecord
from bench.metrics import Summary, summarize
from bench.sim.cluster import ClusterConfig, SimContext
from bench.sim.colocated import ColocatedInstance
from bench.sim.cost import CostModel
from bench.sim.decode import DecodeInstance
from bench.sim.loop import Recorder, SimSeq
from bench.sim.pool import Batcher, Pool
from bench.sim.prefill import PrefillInstance
from bench.workloads import Workload
from scheduler import get_policy

MIN_TREE_RANGE = 2048  # quad-tree range floor: OPT's position table (tokens)


@dataclass
class SimResult:
    """One simulated run of one system."""

    system: str
    events: list[Event]
    iterations: list[IterationRecord]
    num_requests: int
    num_finished: int
    end_time: float  # simulated seconds at the last event
    wall_time: float  # real seconds the simulation took
    policy_time: float  # real seconds spent inside the policy's calls
    num_loop_events: int
    device_busy: dict[str, float] = field(default_factory=dict)  # simulated compute seconds
    blocks_left: dict[str, int] = field(default_factory=dict)  # in use at the end, per kind

    def summary(self, ttft_target: float = math.inf, tpot_target: float = math.inf) -> Summary:
        return summarize(self.system, self.events, self.iterations, ttft_target, tpot_target)


def _pow4_at_least(n: int) -> int:
    size = 4
    while size < n:
        size *= 4
    return size


def check_fits(workload: Workload, config: ClusterConfig, uses_pool: bool,
               uses_staging: bool) -> None:
    """Every request must fit the stores it passes through, or the run could never end.

    Raises:
        ValueError: naming the first request that does not fit and the limit.
    """
    block = config.block_size
    # NOTE: as in the engine, a request above the batch share of decode KV gets the whole
    # cache, and one larger than the staging buffer stays in the host pool until admitted
    # (so `uses_staging` sets no limit).
    limits = [("num_decode_blocks", config.num_decode_blocks)]
    if uses_pool:
        limits += [("num_prefill_blocks", config.num_prefill_blocks),
                   ("num_host_blocks", config.num_host_blocks)]
    for req in workload.requests:
        num_blocks = -(-(req.prompt_len + req.output_len) // block)
        for name, limit in limits:
            if num_blocks > limit:
                raise ValueError(
                    f"request {req.request_id!r} needs {num_blocks} blocks "
                    f"({req.prompt_len} + {req.output_len} tokens) but {name} allows {limit}")


def simulate(workload: Workload, system: str, config: ClusterConfig, cost: CostModel,
             record_tokens: bool = True) -> SimResult:
    """Replays `workload` through the registered policy `system` on the simulated cluster.

    Raises:
        ValueError: for an unknown policy or a request that cannot fit (see check_fits).
    """
    began = time.perf_counter()
    longest = max((r.prompt_len + r.output_len for r in workload.requests), default=1)
    policy = get_policy(system, config.policy_config(_pow4_at_least(max(MIN_TREE_RANGE,
                                                                          longest + 1))))
    check_fits(workload, config, policy.uses_pool, policy.uses_staging)
    ctx = SimContext(config, cost, policy, recorder=Recorder(record_tokens))
    entry = _build_disaggregated(ctx) if policy.uses_pool else _build_colocated(ctx)
    for req in workload.requests:
        seq = SimSeq(req.request_id, req.prompt_len, req.output_len, req.arrival_time)
        ctx.loop.at(req.arrival_time, partial(_arrive, ctx, entry, seq))
    ctx.loop.run()
    return SimResult(
        system=system, events=ctx.recorder.events, iterations=ctx.recorder.iterations,
        num_requests=workload.num_requests, num_finished=ctx.recorder.num_finished,
        end_time=ctx.loop.now, wall_time=time.perf_counter() - began,
        policy_time=ctx.policy_time, num_loop_events=ctx.loop.num_events,
        device_busy={name: dev.busy_time for name, dev in ctx.devices.items()},
        blocks_left=ctx.stores.used(),
    )


class Entry(Protocol):
    """Where requests enter: a prefill instance, or a colocated one."""

    num_waiting_tokens: int

    def submit(self, seq: SimSeq, front: bool = False) -> None: ...


def _arrive(ctx: SimContext, entry: Sequence[Entry], seq: SimSeq) -> None:
    """Admission: the instance with the fewest waiting tokens takes the request."""
    ctx.recorder.event(seq, "arrival", seq.arrival_time)
    target = min(entry, key=lambda instance: instance.num_waiting_tokens)
    target.submit(seq)


def _build_disaggregated(ctx: SimContext) -> list[PrefillInstance]:
    pool = Pool(ctx)
    batcher = Batcher(ctx, pool)
    pool.batcher = batcher
    prefills = [PrefillInstance(ctx, i, pool) for i in range(len(ctx.config.prefill_devices))]
    pool.prefills = prefills
    decodes = [DecodeInstance(ctx, j, pool, batcher, prefills)
               for j in range(len(ctx.config.decode_devices))]
    batcher.staging = [d.staging for d in decodes]
    batcher.deliver_batch = [d.receive_batch for d in decodes]
    batcher.deliver_requests = [d.receive_requests for d in decodes]
    for decode in decodes:
        decode.ask_for_batch()
    return prefills


def _build_colocated(ctx: SimContext) -> list[ColocatedInstance]:
    return [ColocatedInstance(ctx, k, device)
            for k, device in enumerate(ctx.config.colocated_devices)]
