"""The simulated cluster takes the engine's scheduler config: one declaration and one
validation of every policy knob for the engine and the simulator alike."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from aserve.engine.config import EngineConfig, SchedulerConfig
from scheduler import PolicyConfig
from sim import ClusterConfig

BUILDERS: dict[str, Callable[[object], object]] = {
    "SchedulerConfig": lambda v: SchedulerConfig(starvation_threshold=v),
    "EngineConfig": lambda v: EngineConfig.create(starvation_threshold=v),
    "ClusterConfig": lambda v: ClusterConfig.create(starvation_threshold=v),
}


@pytest.mark.parametrize("builder", BUILDERS)
def test_starvation_threshold_is_seconds_at_least_zero_or_none_everywhere(builder: str) -> None:
    build = BUILDERS[builder]
    build(0.0)  # starving from the first second it waits
    build(None)  # off
    with pytest.raises(ValueError, match=r"starvation_threshold \(-1\.0\) must be >= 0 or None"):
        build(-1.0)


def test_cluster_from_engine_config_carries_every_scheduler_knob() -> None:
    engine = EngineConfig.create(min_requests=3, leaf_width=8, starvation_threshold=0.5,
                                 match_slack=0.5, max_spread=None, drain_floor=0.2,
                                 max_batch_size=12, batch_kv_fraction=0.5)
    cluster = ClusterConfig.from_engine(engine, num_host_blocks=64)
    assert cluster.scheduler == engine.scheduler
    # match_slack too, which the simulator once dropped
    knobs = PolicyConfig.of(cluster.scheduler, 1024)
    assert (knobs.min_requests, knobs.leaf_width, knobs.starvation_threshold, knobs.match_slack,
            knobs.max_spread, knobs.drain_floor) == (3, 8, 0.5, 0.5, None, 0.2)


def test_flat_cluster_keywords_reach_the_scheduler_and_unknown_ones_are_named() -> None:
    cluster = ClusterConfig.create(num_decode_blocks=100, min_requests=2, max_spread=None)
    assert (cluster.num_decode_blocks, cluster.scheduler.min_requests,
            cluster.scheduler.max_spread) == (100, 2, None)
    assert cluster.replace(min_requests=5).scheduler.min_requests == 5
    with pytest.raises(ValueError, match="unknown cluster option.*num_gpus"):
        ClusterConfig.create(num_gpus=3)
