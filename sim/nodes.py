"""Clusters of several nodes in the simulator: which node each device is on, and the network
link that a KV move between two nodes takes (its bandwidth and latency), plus
`aserve sim nodes`: two nodes of GPUs, prefill on one and decode on the other, against a
colocated replica on each node, for every policy and link.

    aserve sim nodes --model opt-13b --hardware h100 --gpus-per-node 8 --workload azure-code
        --num-requests 2000 --rate-scale 8 --replica-split 2,6 --links rdma-400g,ethernet-100g
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bench.metrics import Summary, summarize
from bench.report import markdown_table
from bench.workloads import Workload
from scheduler import POLICIES
from scheduler.cost_model import KERNELS, CostModel, CostParams, get_geometry
from scheduler.hardware import GB, get_hardware
from sim.cluster import ClusterConfig, cluster_for
from sim.run import simulate


@dataclass(frozen=True, slots=True)
class NetworkLink:
    """The link from one node to another, per direction (one NIC a node)."""

    name: str
    bandwidth: float  # achievable bytes/s one way
    latency: float  # seconds from the first byte sent to its arrival


# NOTE: achievable rates, about 90 % of the signalling rate; latencies of one RDMA write and
# of a TCP message within one rack
LINKS: dict[str, NetworkLink] = {
    "rdma-400g": NetworkLink("rdma-400g", 400e9 / 8 * 0.9, 5e-6),
    "ethernet-100g": NetworkLink("ethernet-100g", 100e9 / 8 * 0.9, 30e-6),
}


@dataclass(frozen=True, slots=True)
class Hop:
    """One KV move's way between two nodes: a timeline of its own (FIFO), and its link."""

    name: str
    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Network:
    """Which node each device (and the host pool, "host") is on, and the link between any
    two nodes: one NIC a node, or with `nic_per_device` one a device (a GPU with its own
    RDMA NIC, as in 8-GPU servers with eight), so moves into different devices do not
    queue behind each other."""

    nodes: Mapping[str, str]  # device name (or "host") -> node name
    link: NetworkLink
    nic_per_device: bool = False

    def hop(self, src: str, dst: str) -> Hop | None:
        """The way from device `src` to device `dst`; None within one node."""
        a, b = self.nodes.get(src), self.nodes.get(dst)
        if a is None or b is None or a == b:
            return None
        name = f"{src}->{dst}" if self.nic_per_device else f"{a}->{b}"
        return Hop(name, self.link.bandwidth, self.link.latency)


def split_network(config: ClusterConfig, link: NetworkLink,
                  nic_per_device: bool = False) -> Network:
    """Prefill devices and the host pool on one node, decode devices on another (the
    colocated devices of `continuous` are placed as the cluster lists them)."""
    nodes = {dev: "prefill-node" for dev in config.prefill_devices}
    nodes |= {dev: "decode-node" for dev in config.decode_devices}
    return Network(nodes | {"host": "prefill-node"}, link, nic_per_device)


def replica_halves(workload: Workload) -> tuple[Workload, Workload]:
    """The requests of `workload` dealt alternately to two replicas."""
    reqs = workload.requests
    return (Workload(f"{workload.name}-a", reqs[0::2]), Workload(f"{workload.name}-b", reqs[1::2]))


def compare(workload: Workload, systems: list[str], cost: CostModel, gpus_per_node: int,
            replica_split: tuple[int, int], links: list[NetworkLink],
            nic_per_device: bool = False, **overrides: Any) -> list[Summary]:
    """For each system: prefill on one node's GPUs and decode on the other's, over each
    link; then a replica on each node with `replica_split` (prefill, decode) GPUs, the
    requests dealt alternately (merged into one summary)."""
    geometry, hw = cost.geometry, cost.hardware
    split = cluster_for(hw, geometry, gpus_per_node, gpus_per_node, **overrides)
    replica = cluster_for(hw, geometry, *replica_split, **overrides)
    rows = []
    for system in systems:
        for link in links if POLICIES[system].uses_pool else links[:1]:
            result = simulate(workload, system, split, cost,
                              network=split_network(split, link, nic_per_device))
            label = f"{system} split-by-node {link.name}" if POLICIES[system].uses_pool \
                else f"{system} {2 * gpus_per_node} colocated"
            rows.append(summarize(label, result.events, result.iterations))
        halves = [simulate(half, system, replica, cost) for half in replica_halves(workload)]
        label = (f"{system} 2 replicas {replica_split[0]}+{replica_split[1]}"
                 if POLICIES[system].uses_pool else f"{system} 2 replicas x {gpus_per_node}")
        rows.append(summarize(label, [e for h in halves for e in h.events],
                              [it for h in halves for it in h.iterations]))
    return rows


def main(argv: list[str]) -> int:
    """`aserve sim nodes` (see the module)."""
    from sim.cli import PAPER_MIN_REQUESTS, add_workload_args, build_workload

    parser = argparse.ArgumentParser(prog="aserve sim nodes", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(parser)
    parser.add_argument("--model", default="opt-13b", help="model geometry to cost")
    parser.add_argument("--hardware", default="h100", help="device to cost (a preset)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="devices on each node")
    parser.add_argument("--replica-split", default="2,6",
                        help="prefill,decode devices of each node's replica")
    parser.add_argument("--links", default=",".join(LINKS), help="links to compare")
    parser.add_argument("--systems", default=",".join(sorted(POLICIES)), help="policies")
    parser.add_argument("--nic-per-gpu", action="store_true",
                        help="a NIC for each GPU (else one for each node)")
    parser.add_argument("--kernel", default="split-k", choices=KERNELS,
                        help="decode attention kernel to cost")
    args = parser.parse_args(argv)
    geometry, hw = get_geometry(args.model), get_hardware(args.hardware)
    cost = CostModel(geometry, hw, CostParams(), args.kernel)
    prefill, decode = (int(n) for n in args.replica_split.split(","))
    if prefill + decode != args.gpus_per_node:
        raise ValueError(f"replica_split ({args.replica_split}) must add up to "
                         f"gpus_per_node ({args.gpus_per_node})")
    links = [LINKS[name] for name in args.links.split(",")]
    workload = build_workload(args)
    rows = compare(workload, args.systems.split(","), cost, args.gpus_per_node,
                   (prefill, decode), links, args.nic_per_gpu, min_requests=PAPER_MIN_REQUESTS)
    nics = "a NIC per GPU" if args.nic_per_gpu else "one NIC per node"
    print(f"# {workload.name}: {workload.num_requests} requests, {args.model} on 2 x "
          f"{args.gpus_per_node} {hw.name}, {args.kernel} kernel, {nics}; links "
          + ", ".join(f"{x.name} {x.bandwidth / GB:.1f} GB/s {x.latency * 1e6:g} us"
                      for x in links) + "\n")
    print(markdown_table(rows))
    return 0
