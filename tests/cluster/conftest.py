"""One local Ray cluster for the tests of this folder that need one
(`ray.cluster_utils.Cluster`: three raylets on this machine, CPU only): a head node offering
prefill instances and two decode nodes. Those tests skip where Ray is not installed; the
cluster is shut down at the end, also when a test fails, and a test that kills a node adds
one back."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from aserve.cluster.engine import DECODE_RESOURCE, PREFILL_RESOURCE
from tests.conftest import make_config

ray: Any
try:
    import ray
except ImportError:  # the modules that need Ray skip (NEEDS_RAY)
    ray = None
NEEDS_RAY = "the cluster extra (Ray) is not installed"

OBJECT_STORE_BYTES = 80 * 2**20  # per node: KV of opt-tiny moves in far less
# NOTE: a node that dies without saying so is declared dead after this many missed checks
# of this period; Ray's defaults take longer than a test should wait
SYSTEM_CONFIG = {"health_check_period_ms": 500, "health_check_failure_threshold": 4}


@dataclass
class LocalCluster:
    """A running local cluster: its head (prefill) and decode nodes."""

    cluster: Any
    decode_nodes: list[Any] = field(default_factory=list)

    @property
    def address(self) -> str:
        return self.cluster.address  # type: ignore[no-any-return]

    def add_decode_node(self) -> Any:
        node = self.cluster.add_node(num_cpus=1, resources={DECODE_RESOURCE: 1},
                                     object_store_memory=OBJECT_STORE_BYTES)
        self.decode_nodes.append(node)
        return node

    def kill(self, node_id: str) -> None:
        """Kills the raylet and workers of node `node_id` at once, as a crash would."""
        node = next(n for n in self.decode_nodes if n.node_id == node_id)
        self.decode_nodes.remove(node)
        self.cluster.remove_node(node, allow_graceful=False)


def start_cluster(num_decode_nodes: int) -> LocalCluster:
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {PREFILL_RESOURCE: 1},
        "object_store_memory": OBJECT_STORE_BYTES, "include_dashboard": False,
        "_system_config": SYSTEM_CONFIG})
    local = LocalCluster(cluster)
    try:
        for _ in range(num_decode_nodes):
            local.add_decode_node()
        ray.init(address=cluster.address, log_to_driver=False)
    except BaseException:
        cluster.shutdown()
        raise
    return local


NUM_DECODE_NODES = 2


@pytest.fixture(scope="package")
def local_cluster() -> Iterator[LocalCluster]:
    local = start_cluster(NUM_DECODE_NODES)
    try:
        yield local
    finally:
        ray.shutdown()
        local.cluster.shutdown()


def cluster_config(address: str, **kwargs: object) -> Any:
    """The tests' small opt-tiny engine (tests/conftest.py), on the cluster at `address`."""
    return make_config(ray_address=address, **kwargs)
