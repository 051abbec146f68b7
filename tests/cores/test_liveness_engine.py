"""Liveness on the engine driver: the scenarios of tests/sim/test_liveness.py that once
livelocked or starve the stores, through the asyncio engine on a virtual clock (steps take
the cost model's time, deterministic): every request finishes under every registered
policy, and none goes back to the host pool more than a few times."""

from __future__ import annotations

from collections import Counter

import pytest

from aserve.engine.config import EngineConfig, SchedulerConfig
from bench.workloads import Workload, WorkloadRequest
from scheduler import POLICIES, PolicyConfig
from sim import ClusterConfig
from sim.drivers import SimContext
from tests.cores.test_differential import VirtualClockLoop, cost_model, run_engine
from tests.sim.test_liveness import MAX_POOL_MOVES

BLOCK_BYTES = 2 * 2 * 64 * 16 * 4  # opt-tiny, float32: one block of K and V, both layers
DEADLINE = 60.0  # virtual seconds; each scenario's work takes well under one


def requests(*specs: tuple[int, int, float]) -> Workload:
    return Workload("live", tuple(WorkloadRequest(f"r{i}", p, o, t)
                                  for i, (p, o, t) in enumerate(specs)))


SCENARIOS = {
    # two small groups of unlike lengths, one decode block: the strict switch's ping-pong
    "ping-pong": (requests((1, 1, 0.0), (1, 1, 0.0), (1, 1, 0.0), (1, 1, 0.0), (1, 6, 0.0),
                           (6, 5, 0.0)),
                  dict(num_decode_blocks=1, num_prefill_blocks=3, num_staging_blocks=1,
                       host_blocks=3, max_batch_size=32, min_requests=1,
                       starvation_threshold=0.1)),
    # a burst from a few tokens to the context limit; decode holds just the longest
    "burst": (requests(*((4 + 37 * i, 8 + i % 5, 0.0) for i in range(12)), (490, 20, 0.0)),
              dict(num_decode_blocks=32, num_prefill_blocks=64, num_staging_blocks=2,
                   host_blocks=400, max_batch_size=8, min_requests=4,
                   starvation_threshold=0.0)),
    # a trickle with starvation control off and one batch slot
    "trickle": (requests(*((10 + 41 * i, 6, 0.003 * i) for i in range(10))),
                dict(num_decode_blocks=64, num_prefill_blocks=64, num_staging_blocks=64,
                     host_blocks=400, max_batch_size=1, min_requests=1,
                     starvation_threshold=None)),
}


def config(policy: str, host_blocks: int, **kw: object) -> EngineConfig:
    return EngineConfig.create(model="opt-tiny", policy=policy,
                               host_pool_gb=host_blocks * BLOCK_BYTES / 2**30, **kw)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_request_finishes_on_the_engine(policy: str, scenario: str) -> None:
    load, knobs = SCENARIOS[scenario]
    engine_config = config(policy, **knobs)  # type: ignore[arg-type]
    cost = cost_model()
    probe = SimContext(ClusterConfig.from_engine(engine_config, 1), cost,
                       POLICIES[policy](PolicyConfig.of(SchedulerConfig(), 4096)))
    loop = VirtualClockLoop()
    try:
        engine = loop.run_until_complete(run_engine(
            engine_config, cost, probe, load, aborts={}, deadline=DEADLINE))
    finally:
        loop.close()
    finished = {e.seq_id for e in engine.events if e.kind == "finish"}
    assert finished == {r.request_id for r in load.requests}
    transfers = engine.ctx.kv.transfers  # type: ignore[union-attr]
    to_pool = Counter(t.seq_id for t in transfers
                      if t.dst == "host" and not t.src.startswith("prefill"))
    assert max(to_pool.values(), default=0) <= MAX_POOL_MOVES, to_pool.most_common(3)
