"""The Ray driver makes the simulator's decisions: the differential workload of
tests/cores/test_differential.py through a ClusterEngine on the local cluster (prefill on
the head node, decode on another; every forward and every KV copy a real call to a worker,
the copies between nodes through the object store), each call taking no time on a virtual
clock and each step and copy the cost model's time there. The events, iteration records
and KV transfers equal the simulator's, in order, at the same times, under every policy.
Every move is a copy here (stores on two nodes never share a tensor), so the runs compare
with the simulator's copy variant (`share_kv_memory=False`)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from functools import partial
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from aserve.cluster.driver import RayActor
from aserve.cluster.engine import ClusterEngine, start_workers
from aserve.engine.config import SchedulerConfig
from aserve.engine.runner import StepResult
from scheduler import POLICIES as REGISTERED
from scheduler import PolicyConfig, get_policy
from sim import ClusterConfig, simulate
from sim.drivers import SimContext
from tests.cluster import cost_worker
from tests.cluster.conftest import NEEDS_RAY, LocalCluster, ray
from tests.cores import cost_runner
from tests.cores.test_differential import (
    ABORTS,
    STARVATION_THRESHOLD,
    TOLERANCE,
    VirtualClockLoop,
    cost_model,
    decisions,
    engine_config,
    run_engine,
    workload,
)

pytest.importorskip("ray", reason=NEEDS_RAY)

POLICIES = sorted(REGISTERED)  # every registered policy


class Resolved:
    """A remote call already made: its object reference and its value. Awaiting it
    returns the value at once, so the call takes no time on the virtual clock and lets
    nothing run in between, as the cost runner's step in one process."""

    def __init__(self, ref: Any, value: Any) -> None:
        self.ref, self.value = ref, value

    def __await__(self) -> Any:
        if False:  # a generator that returns at once
            yield
        return self.value


class BlockingWorker:
    """A worker handle whose calls (`worker.method.remote(...)`) wait for the worker
    before they return (a Resolved): the driver's code awaits them as it awaits any call,
    and an object a call returned is passed on by reference (node to node)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.handle, name)

        def remote(*args: Any) -> Resolved:
            ref = method.remote(*(a.ref if isinstance(a, Resolved) else a for a in args))
            return Resolved(ref, ray.get(ref))
        return SimpleNamespace(remote=remote)


class CostRayActor(RayActor):
    """The Ray driver's actor; each forward then takes the cost model's time on the
    simulator's timeline of its device."""

    def __init__(self, *args: Any, timelines: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timelines = timelines

    async def forward(self, step: Any) -> StepResult:
        result = await super().forward(step)
        loop = asyncio.get_running_loop()
        end = self.timelines[self.device].run(loop.time(), result.forward_time)[1]
        await asyncio.sleep(end - loop.time())
        return result


class CostClusterEngine(ClusterEngine):
    """A ClusterEngine on the cost model's clock (see the module)."""

    def __init__(self, config: Any, sim_ctx: SimContext, workers: dict[str, Any]) -> None:
        super().__init__(config, workers={n: BlockingWorker(w) for n, w in workers.items()})
        self.sim_ctx = sim_ctx

    async def _open_devices(self) -> tuple[Any, dict[str, Any]]:
        model_config, runners = await super()._open_devices()
        step_time = SimpleNamespace(step_time=self.sim_ctx.cost.iteration_time)
        return model_config, {self.config.decode_devices[0]: step_time}

    def _driver(self) -> Any:
        return partial(CostRayActor, self._context, reopen=self._reopen,
                       timelines=self.sim_ctx.devices)


@pytest.fixture(scope="module")
def cost_workers(local_cluster: LocalCluster) -> Iterator[dict[str, Any]]:
    """A prefill and a decode worker whose runner is the cost model's (passed by value:
    the workers need not import the tests)."""
    for module in (cost_worker, cost_runner):
        ray.cloudpickle.register_pickle_by_value(module)
    config = msgspec.structs.replace(engine_config("aligned"), ray_address=local_cluster.address)
    started = start_workers(config, runner_factory=partial(cost_worker.RemoteCostRunner,
                                                           cost=cost_model()))
    try:
        yield started
    finally:
        for worker in started.values():
            ray.kill(worker, no_restart=True)
        for module in (cost_worker, cost_runner):
            ray.cloudpickle.unregister_pickle_by_value(module)


@pytest.mark.parametrize("policy", POLICIES)
def test_the_ray_driver_and_the_simulator_make_the_same_decisions(
        local_cluster: LocalCluster, cost_workers: dict[str, Any], policy: str) -> None:
    cost = cost_model()
    config = msgspec.structs.replace(
        engine_config(policy, STARVATION_THRESHOLD, share_kv_memory=False),
        ray_address=local_cluster.address)
    sim_ctx = SimContext(ClusterConfig.from_engine(config, 1), cost,
                         get_policy(policy, PolicyConfig.of(SchedulerConfig(), 4096)))
    engine = CostClusterEngine(config, sim_ctx, cost_workers)
    loop = VirtualClockLoop()
    try:
        loop.run_until_complete(run_engine(config, cost, sim_ctx, engine=engine))
    finally:
        loop.close()
    kv: Any = engine.ctx.kv  # type: ignore[union-attr]
    uses_pool = engine.ctx.policy.uses_pool  # type: ignore[union-attr]
    # a pool's stores on the prefill node, the decode cache on another
    assert len(set(kv.holders.values())) == (2 if uses_pool else 1)
    cluster = ClusterConfig.from_engine(config, kv.allocators["host"].num_blocks)
    result = simulate(workload(), policy, cluster, cost, aborts=ABORTS)
    got = decisions(engine.events, engine.iterations, kv.transfers)
    want = decisions(result.events, result.iterations, result.transfers)
    for name, g, w in zip(("events", "iterations", "transfers"), got, want):
        # NOTE: the first difference, not pytest's diff of two long lists (it takes minutes)
        i = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
        assert i == len(g) == len(w), f"{name} differ at {i}: {g[i:i + 3]} != {w[i:i + 3]}"
    assert [e.time for e in engine.events] == pytest.approx(
        [e.time for e in result.events], abs=TOLERANCE)
    if uses_pool:  # KV went from node to node
        assert any(t.src == "staging0" and t.dst == "decode0" for t in kv.transfers)
    engine.check_integrity()
