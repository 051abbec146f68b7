"""End to end: tiny simulations whose timings are checked by hand, and every policy through
a KV-starved cluster (evictions) with all requests finished and every block freed."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest

from aserve.cores import BatcherCore, Window
from bench.metrics import request_metrics
from bench.workloads import Workload, WorkloadRequest, synthetic
from scheduler import POLICIES, PolicyConfig, get_policy
from scheduler.hardware import Hardware
from sim import (
    ClusterConfig,
    CostModel,
    CostParams,
    cluster_for,
    get_geometry,
    get_hardware,
    simulate,
)
from sim.drivers import SimContext
from tests.cores.test_differential import cost_model as differential_cost

SYSTEMS = tuple(sorted(POLICIES))  # every registered policy
FAST = 1e30  # bandwidths and rates so high that only the fixed step overhead counts
EPS = 1e-6  # slack for the (FAST-sized) transfer and roofline times


def _unit_cost() -> CostModel:
    """Every iteration, prefill or decode, takes exactly 1 s; copies take ~0 s."""
    hw = Hardware("test", memory_bandwidth=FAST, matmul_rate=FAST, num_sms=4,
                  memory_bytes=FAST, host_link_bandwidth=FAST, device_link_bandwidth=FAST,
                  host_memory_bytes=FAST)
    params = CostParams(step_overhead=1.0, per_seq_overhead=0.0, bw_efficiency=1.0,
                        flops_efficiency=1.0)
    return CostModel(get_geometry("opt-tiny"), hw, params)


def _workload(*reqs: tuple[str, int, int, float]) -> Workload:
    return Workload("hand", tuple(WorkloadRequest(*r) for r in reqs))


def _config(shared: bool = False, **kw: int) -> ClusterConfig:
    devices = (("dev",), ("dev",)) if shared else (("p0",), ("d0",))
    return ClusterConfig.create(prefill_devices=devices[0], decode_devices=devices[1], **kw)


@pytest.mark.parametrize("system", SYSTEMS)
def test_two_requests_by_hand(system: str) -> None:
    """t=0 one prefill of both (1 s). b wanted 1 token: done at 1. a decodes 1->2, 2->3."""
    result = simulate(_workload(("a", 4, 3, 0.0), ("b", 4, 1, 0.0)), system, _config(),
                      _unit_cost())
    by_id = {m.seq_id: m for m in request_metrics(result.events)}
    a, b = by_id["a"], by_id["b"]
    assert (a.ttft, b.ttft, b.e2e) == (pytest.approx(1.0), pytest.approx(1.0),
                                       pytest.approx(1.0))
    assert a.e2e == pytest.approx(3.0, abs=EPS) and a.tpot == pytest.approx(1.0, abs=EPS)
    assert (a.num_output_tokens, b.num_output_tokens) == (3, 1)
    summary = result.summary()
    assert summary.decode_throughput == pytest.approx(4 / 3.0, rel=1e-5)
    assert [it.batch_size for it in result.iterations][-2:] == [1, 1]
    assert all(n == 0 for n in result.blocks_left.values())


def test_pipeline_events_come_in_life_order() -> None:
    result = simulate(_workload(("a", 4, 3, 0.0)), "aligned", _config(), _unit_cost())
    kinds = [e.kind for e in sorted(result.events, key=lambda e: e.time)]
    assert kinds == ["arrival", "prefill_start", "prefill_end", "first_token", "pooled",
                     "prefetched", "decode_start", "token", "token", "finish"]


@pytest.mark.parametrize(("shared", "fuse", "a_end", "b_ttft", "b_end", "fused"),
                         [(False, True, 3.0, 1.0, 4.0, 0), (True, False, 4.0, 1.5, 5.0, 0),
                          (True, True, 3.0, 1.5, 4.0, 2)])
def test_instances_on_one_device_take_turns(shared: bool, fuse: bool, a_end: float,
                                            b_ttft: float, b_end: float, fused: int) -> None:
    """b arrives at 1.5. Separate devices: b's prefill runs 1.5-2.5 beside a's decode; a ends
    at 3, then b decodes 3-4. One device, steps apart: b's prefill waits for a's step (2-3),
    a's last step runs 3-4, b's decode 4-5. One device, steps fused: b's prefill waits for
    a's step and runs with a's last one (2-3), b decodes 3-4; both record the fused step."""
    result = simulate(_workload(("a", 4, 3, 0.0), ("b", 4, 2, 1.5)), "fcfs",
                      _config(shared=shared).replace(fuse_steps=fuse), _unit_cost())
    by_id = {m.seq_id: m for m in request_metrics(result.events)}
    assert by_id["a"].finish == pytest.approx(a_end, abs=EPS)
    assert by_id["b"].ttft == pytest.approx(b_ttft, abs=EPS)
    assert by_id["b"].finish == pytest.approx(b_end, abs=EPS)
    records = [*result.iterations, *result.prefill_iterations]
    assert sum(r.fused for r in records) == fused


@pytest.mark.parametrize("system", SYSTEMS)
def test_kv_starved_cluster_evicts_yet_finishes_every_request(system: str) -> None:
    workload = synthetic(40, short_ratio=0.7, short_range=(8, 40), long_range=(40, 120),
                         output_range=(20, 80), seed=3)
    config = _config(block_size=4, num_decode_blocks=64, num_prefill_blocks=64,
                     num_staging_blocks=64, num_host_blocks=4096, min_requests=2)
    result = simulate(workload, system, config, _unit_cost())
    assert result.num_finished == workload.num_requests
    tokens = {m.seq_id: m.num_output_tokens for m in request_metrics(result.events)}
    assert tokens == {r.request_id: r.output_len for r in workload.requests}
    assert Counter(e.kind for e in result.events)["evicted"] > 0
    assert all(n == 0 for n in result.blocks_left.values())
    num_instances = len(config.colocated_devices if system == "continuous"
                        else config.decode_devices)
    assert max(it.blocks_used["decode"] for it in result.iterations) <= 64 * num_instances


def test_a_request_larger_than_the_decode_store_is_refused() -> None:
    config = _config(block_size=4, num_decode_blocks=10)
    with pytest.raises(ValueError, match="num_decode_blocks"):
        simulate(_workload(("big", 40, 10, 0.0)), "aligned", config, _unit_cost())


def test_a_request_larger_than_the_staging_buffer_bypasses_it() -> None:
    """As in the engine's batcher: what staging cannot take stays in the host pool and is
    copied straight to decode when admitted (no "prefetched" event for it)."""
    config = _config(block_size=4, num_staging_blocks=5)
    for system in ("aligned", "aligned-noprefetch"):
        result = simulate(_workload(("big", 24, 8, 0.0)), system, config, _unit_cost())
        assert result.num_finished == 1
        assert not [e for e in result.events if e.kind == "prefetched"]


def test_unknown_system_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        simulate(_workload(("a", 4, 3, 0.0)), "lifo", _config(), _unit_cost())


@pytest.mark.parametrize("system", SYSTEMS)
@pytest.mark.parametrize("seed", [0, 1])
def test_gpu_cluster_under_load_finishes_everything(system: str, seed: int) -> None:
    """Regression: a want while a batch was in flight once made the batcher overwrite it."""
    geometry, hw = get_geometry("opt-1.3b"), get_hardware("a100")
    config = cluster_for(hw, geometry, 1, 2, min_requests=16)
    workload = synthetic(80, rate=60.0, seed=seed)
    result = simulate(workload, system, config, CostModel(geometry, hw, kernel="split-k"))
    assert result.num_finished == workload.num_requests
    assert all(n == 0 for n in result.blocks_left.values())


@pytest.mark.parametrize("seed", [0, 1])
def test_aligned_returns_stragglers_to_the_pool_and_finishes_everything(seed: int) -> None:
    geometry, hw = get_geometry("opt-1.3b"), get_hardware("a100")
    config = cluster_for(hw, geometry, 1, 1, min_requests=16, num_decode_blocks=1200)
    workload = synthetic(120, rate=200.0, seed=seed)
    result = simulate(workload, "aligned", config, CostModel(geometry, hw, kernel="split-k"))
    assert result.num_finished == workload.num_requests
    assert all(n == 0 for n in result.blocks_left.values())
    returned = sum(1 for e in result.events if e.kind == "evicted")
    assert returned > 0  # the small decode cache forces switches that return requests


@pytest.mark.parametrize("share", [False, True])
def test_cpu_copies_take_device_time_unless_the_stores_share_one_tensor(share: bool) -> None:
    """On a CPU cluster (one device for prefill and decode), KV copies occupy the device:
    its busy time is the forwards plus every copy. Where the stores share one KV tensor
    (the default) a move hands the block table over: no copy, no device time."""
    hw = Hardware("cpu", memory_bandwidth=FAST, matmul_rate=FAST, num_sms=2, memory_bytes=FAST,
                  host_link_bandwidth=1e6, device_link_bandwidth=1e6, host_memory_bytes=FAST)
    params = CostParams(step_overhead=1.0, per_seq_overhead=0.0, bw_efficiency=1.0,
                        flops_efficiency=1.0)
    cost = CostModel(get_geometry("opt-tiny"), hw, params)
    block_s = cost.kv_bytes(1, 16) / 1e6  # seconds to copy one 16-token block
    workload = _workload(("a", 16, 4, 0.0), ("b", 16, 4, 0.0))
    config = ClusterConfig.create(min_requests=1, max_batch_size=2, share_kv_memory=share)
    result = simulate(workload, "fcfs", config, cost)
    forwards = 1 + len(result.iterations)  # one packed prefill, then the decode iterations
    # each request's one block goes over the host link twice (offload, prefetch); staging
    # -> decode is a copy within the one device, at its (FAST) memory bandwidth
    copies = 0 if share else 4 * block_s
    assert len(result.transfers) == 6  # the same moves either way
    assert result.device_busy["cpu"] == pytest.approx(forwards + copies)
    assert result.end_time >= forwards + copies - EPS


def _long_request_wait(system: str, threshold: float | None) -> float:
    """Simulated seconds a long request waits from the pool to its first decode step while
    groups of short requests keep arriving faster than decode drains them (the engine's
    tests/cores/test_starvation.py scenario, on a 15 ms step)."""
    rng = random.Random(1)
    reqs = []
    for i in range(400):
        reqs.append(WorkloadRequest(f"s{i}", rng.randint(20, 40), 24, (i // 8) * 0.04))
        if i == 16:  # after the first batches formed, so it cannot join them
            reqs.append(WorkloadRequest("long", 600, 8, (i // 8) * 0.04))
    config = _config(num_decode_blocks=48, min_requests=4, max_batch_size=16)
    config = config.replace(starvation_threshold=threshold)
    cost = _unit_cost()
    cost = CostModel(cost.geometry, cost.hardware, replace(cost.params, step_overhead=0.015))
    if system == "aligned":  # NOTE: a padded cost, whose spread shows: under a total-work
        cost = differential_cost("padded")  # one it admits in arrival order: no starving
    result = simulate(Workload("starve", tuple(reqs)), system, config, cost)
    times: dict[str, float] = {}
    for e in result.events:
        if e.seq_id == "long":
            times.setdefault(e.kind, e.time)
    return times["decode_start"] - times["pooled"]


@pytest.mark.parametrize("system", ["aligned", "aligned-loose"])
def test_starvation_control_acts_in_simulation(system: str) -> None:
    """The simulator passes its clock to the policy at decode boundaries and to dynamic
    prefetch: without that, aligned-loose kept the long request out
    for as long as short ones kept coming (~9.7 s), as if starvation control were off."""
    wait_on, wait_off = _long_request_wait(system, 0.3), _long_request_wait(system, None)
    assert wait_off > 3 * wait_on, (wait_on, wait_off)


@pytest.mark.parametrize("system", ["fcfs", "aligned"])
def test_the_pool_sends_each_batch_to_the_waiting_instance_with_the_most_room(
        system: str) -> None:
    """Requests that reach the pool one at a time, while every decode instance waits for a
    batch, are spread over the instances: each goes where the most room is, not to
    decode0 each time (which then ran every request in one growing batch while the other
    two idled)."""
    config = ClusterConfig.create(prefill_devices=("p",), decode_devices=("d0", "d1", "d2"))
    workload = _workload(*((f"r{i}", 8, 12, 1.5 * i) for i in range(6)))  # one per prefill
    result = simulate(workload, system, config, _unit_cost())
    assert result.num_finished == 6
    widest = Counter()
    for it in result.iterations:
        if it.instance.startswith("decode"):
            widest[it.instance] = max(widest[it.instance], it.batch_size)
    assert sorted(widest) == ["decode0", "decode1", "decode2"]
    assert max(widest.values()) == 2


def test_the_decode_window_with_the_most_room_matches_first() -> None:
    """Dynamic prefetch serves the decode instances' windows roomiest first (free slots,
    then blocks), not by index: in index order decode0 had the first pick of every pooled
    request, ran the largest batches and set the makespan."""
    config = ClusterConfig.create(prefill_devices=("p",), decode_devices=("d0", "d1", "d2"))
    ctx = SimContext(config, _unit_cost(), get_policy("aligned-loose", PolicyConfig()))
    batcher = BatcherCore(ctx)
    batcher.report_window(0, Window(10, 100, max_blocks=500, max_requests=2))
    batcher.report_window(1, Window(10, 100, max_blocks=50, max_requests=20))
    batcher.report_window(2, Window(10, 100, max_blocks=400, max_requests=20))
    assert batcher.match_order() == [2, 1, 0]
    batcher.pending.discard(2)
    assert batcher.match_order() == [1, 0]
