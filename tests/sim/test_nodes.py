"""The simulator across nodes (sim/nodes.py): a KV move between two nodes takes the
network link's latency plus its bytes at the link's bandwidth, queued on that link; moves
within a node keep their own links; and the two-node comparison covers every policy."""

from __future__ import annotations

import pytest

from bench.workloads import Workload, WorkloadRequest
from scheduler import POLICIES
from scheduler.cost_model import CostModel, CostParams, get_geometry
from scheduler.hardware import get_hardware
from sim import simulate
from sim.cluster import cluster_for
from sim.nodes import LINKS, compare, replica_halves, split_network

COST = CostModel(get_geometry("opt-1.3b"), get_hardware("h100"), CostParams(), "split-k")


def workload(n: int = 24) -> Workload:
    return Workload("nodes", tuple(WorkloadRequest(f"r{i}", 200 + 37 * i, 16, 0.01 * i)
                                   for i in range(n)))


@pytest.mark.parametrize("link", sorted(LINKS))
def test_a_move_between_nodes_takes_the_links_time(link: str) -> None:
    cluster = cluster_for(COST.hardware, COST.geometry, 1, 1)
    net = split_network(cluster, LINKS[link])
    result = simulate(workload(), "fcfs", cluster, COST, network=net)
    local = simulate(workload(), "fcfs", cluster, COST)
    first = next(t for t in result.transfers if t.src == "staging0" and t.dst == "decode0")
    num_bytes = COST.kv_bytes(first.num_blocks, cluster.block_size)
    assert first.end_time - first.start_time == pytest.approx(
        LINKS[link].latency + num_bytes / LINKS[link].bandwidth)
    # host -> staging stays on the prefill node: the same time as on one node
    offloads = [t.end_time - t.start_time for t in result.transfers if t.src == "host"]
    assert offloads[0] == pytest.approx(next(t.end_time - t.start_time
                                             for t in local.transfers if t.src == "host"))
    assert result.num_finished == local.num_finished == workload().num_requests
    assert result.end_time > local.end_time  # the network is slower than NVLink


def test_the_slower_link_delays_the_decode_nodes_kv() -> None:
    cluster = cluster_for(COST.hardware, COST.geometry, 1, 1)
    ends = {name: simulate(workload(), "fcfs", cluster, COST,
                           network=split_network(cluster, link)).end_time
            for name, link in LINKS.items()}
    assert ends["ethernet-100g"] > ends["rdma-400g"]


def test_a_nic_per_device_keeps_moves_into_two_devices_apart() -> None:
    cluster = cluster_for(COST.hardware, COST.geometry, 1, 2)
    shared, apart = (split_network(cluster, LINKS["rdma-400g"], per) for per in (False, True))
    assert shared.hop("gpu0", "gpu1") == shared.hop("gpu0", "gpu2")
    assert apart.hop("gpu0", "gpu1") != apart.hop("gpu0", "gpu2")
    assert shared.hop("gpu1", "gpu2") is None  # within the decode node


def test_replicas_share_the_requests_alternately() -> None:
    a, b = replica_halves(workload(5))
    assert [r.request_id for r in a.requests] == ["r0", "r2", "r4"]
    assert [r.request_id for r in b.requests] == ["r1", "r3"]


def test_the_two_node_comparison_covers_every_policy_and_link() -> None:
    rows = compare(workload(), sorted(POLICIES), COST, 2, (1, 1), list(LINKS.values()))
    pooled = [p for p in POLICIES if POLICIES[p].uses_pool]
    assert len(rows) == len(pooled) * (len(LINKS) + 1) + 2 * (len(POLICIES) - len(pooled))
    assert all(row.num_requests == workload().num_requests for row in rows)
