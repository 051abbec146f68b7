"""The engine driver and the simulator run the same cores: one workload (a starving long
request, evictions, aborts, batch switches) through the asyncio engine with a runner whose
steps take the cost model's time, on a virtual clock, and through the simulator, yields the
same batch decisions, KV moves and lifecycle events in the same order at the same times,
whether the KV stores hand block tables over (one tensor) or copy (a tensor each)."""

from __future__ import annotations

import asyncio
import math
import random
import selectors
from typing import Any

import pytest

from aserve.engine.config import EngineConfig, SchedulerConfig
from aserve.engine.engine import Engine
from aserve.engine.sequence import Request, SamplingParams
from bench.workloads import Workload, WorkloadRequest
from scheduler import POLICIES as REGISTERED
from scheduler import PolicyConfig, aligned, get_policy
from scheduler.cost_model import KernelKind
from scheduler.hardware import Hardware
from sim import ClusterConfig, CostModel, CostParams, get_geometry, simulate
from sim.drivers import SimContext
from sim.run import arrival_stamps
from tests.cores.cost_runner import CostRunner

TOLERANCE = 1e-6  # seconds; both drivers compute the same sums on the same clock
ABORTS = {"s12": 0.09, "s24": 0.14, "s60": 0.3}  # decoding, pooled, just arrived
# NOTE: low enough that starvation control changes decisions of every policy that has it
# here (at 0.3 only aligned-strict's): dropping the rule from one driver must show
STARVATION_THRESHOLD = 0.1  # seconds


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock jumps to the next timer whenever nothing is ready, so a
    run takes simulated, not real, time (threads still block it for real)."""

    def __init__(self) -> None:
        super().__init__(selectors.DefaultSelector())
        self._virtual_time = 0.0
        select = self._selector.select

        def jump(timeout: float | None = None) -> list:  # type: ignore[type-arg]
            events = select(0)
            if events or timeout == 0:
                return events
            if timeout is None:
                return select(None)
            self._virtual_time += timeout
            return []

        self._selector.select = jump  # type: ignore[method-assign]

    def time(self) -> float:
        return self._virtual_time


def workload() -> Workload:
    """Groups of short requests every 40 ms, faster than decode drains them, and one long
    request that only starvation control lets in."""
    rng = random.Random(1)
    reqs = []
    for i in range(64):
        reqs.append(WorkloadRequest(f"s{i}", rng.randint(20, 40), rng.randint(10, 30),
                                    0.001 + (i // 8) * 0.04))
        if i == 16:
            reqs.append(WorkloadRequest("long", 600, 8, 0.001 + (i // 8) * 0.04))
    return Workload("differential", tuple(reqs))


def cost_model(kernel: KernelKind = "split-k") -> CostModel:
    hw = Hardware("diff-gpu", memory_bandwidth=2e9, matmul_rate=1e12, num_sms=8,
                  memory_bytes=1e12, host_link_bandwidth=2e8, device_link_bandwidth=1e9,
                  host_memory_bytes=1e12)
    return CostModel(get_geometry("opt-tiny"), hw, CostParams(step_overhead=0.005), kernel)


def engine_config(policy: str, starvation_threshold: float | None = 0.3,
                  share_kv_memory: bool = True, fuse_steps: bool = False) -> EngineConfig:
    """The workload's engine. NOTE: its evictions and starvation happen at the timings of
    steps run apart (`fuse_steps` False); fused steps shift them."""
    return EngineConfig.create(model="opt-tiny", policy=policy, num_decode_blocks=48,
                               num_prefill_blocks=128, num_staging_blocks=64,
                               host_pool_gb=0.002, min_requests=4, max_batch_size=16,
                               starvation_threshold=starvation_threshold,
                               share_kv_memory=share_kv_memory, fuse_steps=fuse_steps,
                               trace_limit=None)  # compared with the simulator's whole log


async def run_engine(config: EngineConfig, cost: CostModel, sim_ctx: SimContext,
                     load: Workload | None = None, aborts: dict[str, float] = ABORTS,
                     deadline: float = math.inf, engine: Engine | None = None) -> Engine:
    """`load` (by default the workload above) through the engine driver (or `engine`, a
    driver of its own); KV copies take the simulator's link time, after the driver's own
    `transfer` where it has one (the Ray driver's copies between nodes). Stops at virtual
    time ``deadline`` even with requests live."""
    engine = engine or Engine(config, CostRunner.factory(cost, sim_ctx.devices))
    await engine.start()
    loop = asyncio.get_running_loop()
    kv = engine.ctx.kv  # type: ignore[union-attr]
    hand_over = kv.copy  # the engine's own: a hand-over between stores of one tensor
    carry = getattr(kv, "transfer", None)

    async def copy(move, clock) -> None:  # type: ignore[no-untyped-def]
        if move.handover:
            return await hand_over(move, clock)
        start = clock()
        if carry is not None:
            await carry(move)
        landed = sim_ctx.transfer(move, start)
        await asyncio.sleep(landed - start)
        kv.commit(move, start, landed)

    kv.copy = copy  # type: ignore[method-assign]
    engine.ctx.clock = loop.time  # type: ignore[union-attr]
    queues = []
    load = load or workload()
    # NOTE: Engine.make_request stamps each request with its clock at submission, which
    # strictly increases; the simulator stamps the same way (sim.run.arrival_stamps)
    stamps = dict(zip((r.request_id for r in load.requests), arrival_stamps(load)))
    timeline = sorted([(r.arrival_time, 0, r) for r in load.requests]
                      + [(t, 1, seq_id) for seq_id, t in aborts.items()], key=lambda x: x[:2])
    for at, kind, item in timeline:
        if at > loop.time():  # what happens at one time happens without a yield between
            await asyncio.sleep(at - loop.time())
        if kind == 1:
            engine.abort(item)  # type: ignore[arg-type]
            continue
        queues.append(engine.submit(Request(
            request_id=item.request_id, prompt_token_ids=(0,) * item.prompt_len,
            sampling=SamplingParams(max_tokens=item.output_len, ignore_eos=True),
            arrival_time=stamps[item.request_id])))
    while engine.stats()["live"] and loop.time() < deadline:
        await asyncio.sleep(0.01)
    await engine.stop()
    return engine


def run_on_virtual_clock(config: EngineConfig, cost: CostModel, sim_ctx: SimContext,
                         load: Workload | None = None,
                         aborts: dict[str, float] = ABORTS) -> Engine:
    """`run_engine` on a VirtualClockLoop: deterministic, and as fast as the events allow."""
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(run_engine(config, cost, sim_ctx, load, aborts))
    finally:
        loop.close()


def decisions(events, iterations, transfers) -> tuple[list, list, list]:  # type: ignore[no-untyped-def]
    return ([(e.seq_id, e.kind) for e in events],
            [(it.instance, it.batch_size, it.min_len, it.max_len, it.is_mixed)
             for it in iterations],
            [(t.seq_id, t.src, t.dst, t.num_blocks) for t in transfers])


POLICIES = sorted(REGISTERED)  # every registered policy


def both_drivers(config: EngineConfig, cost: CostModel) -> tuple[Engine, Any, tuple, tuple]:  # type: ignore[type-arg]
    """The workload through the engine (virtual clock) and the simulator under `config`:
    both runs and both sides' `decisions`, asserted equal, at the same times."""
    policy = config.scheduler.policy
    probe = SimContext(ClusterConfig.from_engine(config, 1), cost,
                       get_policy(policy, PolicyConfig.of(SchedulerConfig(), 4096)))
    engine = run_on_virtual_clock(config, cost, probe)
    kv = engine.ctx.kv  # type: ignore[union-attr]
    cluster = ClusterConfig.from_engine(config, kv.allocators["host"].num_blocks)
    result = simulate(workload(), policy, cluster, cost, aborts=ABORTS)
    engine_side = decisions(engine.events, engine.iterations, kv.transfers)
    sim_side = decisions(result.events, result.iterations, result.transfers)
    for name, got, want in zip(("events", "iterations", "transfers"), engine_side, sim_side):
        assert got == want, name
    assert [e.time for e in engine.events] == pytest.approx(
        [e.time for e in result.events], abs=TOLERANCE)
    assert [it.start_time for it in engine.iterations] == pytest.approx(
        [it.start_time for it in result.iterations], abs=TOLERANCE)
    return engine, result, engine_side, sim_side


@pytest.mark.parametrize("policy", ["aligned", "fcfs", "continuous"])
def test_fused_steps_run_the_same_on_both_drivers(policy: str) -> None:
    """With the prefill and decode instances' steps fused on their one device, the engine
    and the simulator still decide and time alike, and fuse the same steps (a colocated
    instance is alone on its device: nothing to fuse)."""
    config = engine_config(policy, STARVATION_THRESHOLD, fuse_steps=True)
    engine, result, _, _ = both_drivers(config, cost_model())
    engine_fused = [(r.instance, r.start_time) for r in (*engine.iterations,
                                                          *engine.prefill_iterations) if r.fused]
    sim_fused = [(r.instance, r.start_time) for r in (*result.iterations,
                                                       *result.prefill_iterations) if r.fused]
    assert len(engine_fused) == len(sim_fused)
    assert (len(sim_fused) > 0) == (policy != "continuous")
    assert {name for name, _ in sim_fused} <= {"prefill0", "decode0"}


@pytest.mark.parametrize("policy", ["aligned", "fcfs"])
def test_a_step_woken_by_a_forwards_end_joins_the_next_forward(policy: str) -> None:
    """Two prompts, room to prefill one at a time, steps fused on one device: when the first
    prefill ends, the prefill instance submits the second prompt and the decode instance,
    handed the first one in that instant, its first step; the engine's queue yields once
    before a forward, so both run as one, and the simulator runs them as one too (a
    forward started on the first submission would leave the first seq's second token
    waiting for a prefill alone, as on a CPU it did for a whole prefill step)."""
    load = Workload("two", (WorkloadRequest("a", 40, 4, 0.001),
                            WorkloadRequest("b", 40, 4, 0.001)))
    config = EngineConfig.create(model="opt-tiny", policy=policy, num_decode_blocks=48,
                                 num_prefill_blocks=3, num_staging_blocks=64,
                                 host_pool_gb=0.002, min_requests=1, max_batch_size=16,
                                 fuse_steps=True, trace_limit=None)
    cost = cost_model()
    probe = SimContext(ClusterConfig.from_engine(config, 1), cost,
                       get_policy(policy, PolicyConfig.of(SchedulerConfig(), 4096)))
    engine = run_on_virtual_clock(config, cost, probe, load=load, aborts={})
    host_blocks = engine.ctx.kv.allocators["host"].num_blocks  # type: ignore[union-attr]
    result = simulate(load, policy, ClusterConfig.from_engine(config, host_blocks), cost)

    def steps(records) -> list[tuple[str, int, bool]]:  # type: ignore[no-untyped-def]
        return [(r.instance, r.batch_size, r.fused)
                for r in sorted(records, key=lambda r: (r.start_time, r.instance))]

    engine_steps = steps([*engine.iterations, *engine.prefill_iterations])
    assert engine_steps[:3] == [("prefill0", 1, False), ("decode0", 1, True),
                                ("prefill0", 1, True)]
    assert steps([*result.iterations, *result.prefill_iterations]) == engine_steps
    assert [e.time for e in result.events] == pytest.approx(
        [e.time for e in engine.events], abs=TOLERANCE)


# NOTE: all stores are on one device here, so by default every move is a hand-over that
# lands at once; with a tensor per store each move is a copy that takes link time
@pytest.mark.parametrize("policy,headroom,share", [(p, None, True) for p in POLICIES]
                         + [("aligned", 0, True)]  # without headroom, aligned evicts here too
                         + [(p, None, False) for p in ("aligned", "aligned-strict", "fcfs")]
                         + [("aligned", 0, False)])
def test_engine_and_simulator_make_the_same_decisions(policy: str, headroom: int | None,
                                                      share: bool,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    if headroom is not None:
        monkeypatch.setattr(aligned, "HEADROOM_STEPS", headroom)
    cost = cost_model()
    config = engine_config(policy, STARVATION_THRESHOLD, share)
    engine, result, engine_side, sim_side = both_drivers(config, cost)
    kv = engine.ctx.kv  # type: ignore[union-attr]
    assert all((t.end_time == t.start_time) == share for t in kv.transfers)
    cluster = ClusterConfig.from_engine(config, kv.allocators["host"].num_blocks)
    kinds = {k for _, k in engine_side[0]}
    assert "finish" in kinds
    # aligned (and its no-prefetch variant) keeps room for its running seqs' growth
    # (scheduler/aligned.py's headroom), so in this workload only its headroom-off run evicts
    if policy not in ("aligned", "aligned-noprefetch") or headroom == 0:
        assert "evicted" in kinds
    if policy != "continuous":  # a batch switch mixed two batches
        assert any(mixed for *_, mixed in engine_side[1])
    if policy.startswith("aligned"):  # the workload exercises starvation control
        without = simulate(workload(), policy, cluster.replace(starvation_threshold=None), cost,
                           aborts=ABORTS)
        assert decisions(without.events, without.iterations, without.transfers) != sim_side
    aborted = {seq_id for seq_id, _ in ABORTS.items()
               if len([e for e in engine.events if e.seq_id == seq_id and e.kind == "token"])
               < next(r.output_len for r in workload().requests if r.request_id == seq_id) - 1}
    assert aborted == set(ABORTS)  # each ended early
