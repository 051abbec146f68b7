"""Run one workload through one policy on a simulated cluster; the result holds the same
lifecycle events and iteration records as an engine run, so bench.metrics applies as is.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

from aserve.engine.sequence import (
    Event,
    IterationRecord,
    Request,
    SamplingParams,
    SeqState,
    TransferRecord,
)
from bench.metrics import DEFAULT_TPOT_SLO, Summary, summarize
from bench.workloads import Workload
from scheduler import PolicyConfig, get_policy, tree_range
from scheduler.cost_model import CostModel
from sim.cluster import ClusterConfig
from sim.drivers import Instance, SimContext

if TYPE_CHECKING:
    from sim.nodes import Network

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
    transfers: list[TransferRecord] = field(default_factory=list)  # every KV move
    prefill_iterations: list[IterationRecord] = field(default_factory=list)  # prefills' steps

    def summary(self, ttft_target: float = math.inf,
                tpot_target: float = DEFAULT_TPOT_SLO) -> Summary:
        return summarize(self.system, self.events, self.iterations, ttft_target, tpot_target)


def simulate(workload: Workload, system: str, config: ClusterConfig, cost: CostModel,
             record_tokens: bool = True, aborts: Mapping[str, float] | None = None,
             horizon: float = math.inf, max_events: int | None = None,
             network: Network | None = None) -> SimResult:
    """Replays `workload` through the registered policy `system` on the simulated cluster;
    `aborts` ends the named requests at the given times, as `Engine.abort` would. The run
    stops at simulated time `horizon` or after `max_events` loop events, whichever comes
    first, so a run that stops making progress ends with `num_finished < num_requests`.
    With a `network` (sim/nodes.py) the devices sit on its nodes, and KV moves between
    two nodes take its link.

    Raises:
        ValueError: for an unknown policy or a request that cannot fit
            (`BlockLedger.check_fits`).
    """
    began = time.perf_counter()
    longest = max((r.prompt_len + r.output_len for r in workload.requests), default=1)
    policy = get_policy(system, PolicyConfig.of(config.scheduler, tree_range(
        max(MIN_TREE_RANGE, longest + 1))), cost.iteration_time)
    ctx = SimContext(config, cost, policy, record_tokens, network)
    ctx.wiring.connect(partial(Instance, ctx), ctx, ctx.decode_devices)
    for req, at in zip(workload.requests, arrival_stamps(workload), strict=True):
        ctx.kv.check_fits(req.prompt_len + req.output_len, policy.uses_pool,
                          f"request {req.request_id!r}")
        request = Request(request_id=req.request_id, prompt_token_ids=(0,) * req.prompt_len,
                          sampling=SamplingParams(max_tokens=req.output_len, ignore_eos=True),
                          arrival_time=at)
        ctx.loop.at(req.arrival_time, partial(_arrive, ctx, request))
    for seq_id, at in (aborts or {}).items():
        ctx.loop.at(at, partial(_abort, ctx, seq_id))
    ctx.loop.run(until=horizon, max_events=max_events)
    return SimResult(
        system=system, events=ctx.life.events, iterations=ctx.life.iterations,
        num_requests=workload.num_requests, num_finished=ctx.life.num_finished,
        end_time=ctx.loop.now, wall_time=time.perf_counter() - began,
        policy_time=ctx.policy_time, num_loop_events=ctx.loop.num_events,
        device_busy={name: dev.busy_time for name, dev in ctx.devices.items()},
        blocks_left=ctx.kv.blocks_used(), transfers=ctx.kv.transfers,
        prefill_iterations=ctx.life.prefill_iterations,
    )


def arrival_stamps(workload: Workload) -> list[float]:
    """Each request's arrival time as the engine stamps it: its clock when the request is
    submitted, which strictly increases, so requests submitted together (an offline replay
    submits them all at time 0, in workload order) queue in submission order. With the
    workload's tied times, the cores would break ties by request id, a string ("x-10"
    before "x-2"): `continuous` would admit prompts in another order than the engine. A
    request that ties an earlier one is stamped one ulp after it, which no metric can see.
    """
    stamps: list[float] = []
    last: dict[float, float] = {}  # workload time -> the latest stamp given for it
    for req in workload.requests:
        at = req.arrival_time
        last[at] = math.nextafter(last[at], math.inf) if at in last else at
        stamps.append(last[at])
    return stamps


def _arrive(ctx: SimContext, request: Request) -> None:
    """Admission, as `Engine.submit`: the entry instance with the fewest waiting tokens."""
    ctx.life.event(request.request_id, "arrival", request.arrival_time)
    ctx.wiring.submit(SeqState.from_request(request))


def _abort(ctx: SimContext, seq_id: str) -> None:
    """`Engine.abort`: idle holders end the request now, the others at their next step."""
    ctx.life.abort(seq_id)
    ctx.wiring.reap(ctx.loop.now)
