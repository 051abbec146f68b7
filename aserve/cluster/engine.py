"""ClusterEngine: the engine with its instances on the nodes of a Ray cluster. The front
end (this process: admission, streams, the cores and their block ledger) is the engine's;
each instance's model and KV tensors live in a NodeWorker actor placed on a node by role.

Placement: a prefill instance needs one unit of the `aserve_prefill` resource, a decode
instance (or a colocated one, under `continuous`) one of `aserve_decode`; a node offers
them when started so (`ray start --resources '{"aserve_decode": 1}'`). The host KV pool
and decode instance j's candidate buffer live with prefill instance j mod P, as on one
machine (the paper's layout), so the batcher's pool is on the prefill side.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch

from aserve.cluster.driver import RayActor, RayKVSpace
from aserve.cluster.worker import NodeWorker
from aserve.cores import kv_stores
from aserve.engine.config import EngineConfig
from aserve.engine.engine import Engine, RunnerFactory
from aserve.engine.errors import EngineError, NodeLost
from aserve.engine.sequence import IterationRecord
from scheduler.policy import POLICIES
from transport.kv import KVGeometry
from transport.remote import InterNodeTransport, ObjectStoreTransport

logger = logging.getLogger(__name__)
PREFILL_RESOURCE = "aserve_prefill"  # a node's units of prefill instances
DECODE_RESOURCE = "aserve_decode"  # a node's units of decode (or colocated) instances
START_TIMEOUT_S = 300.0  # seconds the workers may take to be placed and load the model


def instances(prefill_devices: tuple[str, ...], decode_devices: tuple[str, ...],
              uses_pool: bool) -> dict[str, tuple[str, str]]:
    """Every instance by name, with its device and the resource that places it."""
    out = {f"prefill{i}": (dev, PREFILL_RESOURCE)
           for i, dev in enumerate(prefill_devices)} if uses_pool else {}
    out |= {f"decode{j}": (dev, DECODE_RESOURCE) for j, dev in enumerate(decode_devices)}
    return out


def holders(stores: Mapping[str, tuple[str, int]], num_prefill: int,
            uses_pool: bool) -> dict[str, str]:
    """The instance whose worker holds each store: its own scratch or cache; staging{j}
    and the host pool on the prefill side (prefill j mod P, prefill0). Without a pool only
    the decode caches exist on the cluster."""
    out = {}
    for name in stores:
        if name.startswith(("prefill", "decode")):
            out[name] = name
        elif uses_pool and name.startswith("staging"):
            out[name] = f"prefill{int(name[len('staging'):]) % num_prefill}"
        elif uses_pool and name == "host":
            out[name] = "prefill0"
    return {name: worker for name, worker in out.items()
            if uses_pool or not name.startswith("prefill")}


def start_workers(config: EngineConfig, uses_pool: bool = True,
                  runner_factory: RunnerFactory | None = None) -> dict[str, Any]:
    """One NodeWorker actor per instance of `config`, by instance name, each placed by its
    role's resource and restarted by Ray on a node that offers it, should its node die
    (the process must be connected to Ray). `runner_factory` is built on each worker."""
    import ray

    remote = ray.remote(NodeWorker)
    return {name: remote.options(
        resources={resource: 1}, num_cpus=0,
        num_gpus=1 if torch.device(dev).type == "cuda" else 0, max_restarts=-1,
    ).remote(config.model, dev, config.cache.block_size, config.seed, config.num_threads,
             runner_factory)
        for name, (dev, resource) in instances(config.prefill_devices, config.decode_devices,
                                               uses_pool).items()}


class ClusterEngine(Engine):
    """An Engine whose instances run on the nodes of the Ray cluster at
    `config.ray_address` (see the module). `runner_factory` is built on each worker.

    `workers` (from `start_workers`, for this config's instances; the models they loaded
    are kept) are used instead of starting new ones, and left running at `stop`: a front
    end can start again without reloading the nodes. Their stores are opened afresh."""

    def __init__(self, config: Any = None, runner_factory: RunnerFactory | None = None,
                 transport: InterNodeTransport | None = None,
                 workers: Mapping[str, Any] | None = None) -> None:
        super().__init__(config, runner_factory)
        if self.config.ray_address is None:
            raise ValueError("ray_address must name a Ray cluster ('auto' or HOST:PORT)")
        self._worker_factory = runner_factory
        self.transport = transport or ObjectStoreTransport()
        self._owns_workers = workers is None
        self.workers: dict[str, Any] = dict(workers or {})  # instance -> its NodeWorker actor
        self.nodes: dict[str, str] = {}  # instance -> the Ray node id it last ran on
        self._uses_pool = True
        self._connected = False  # this engine connected the process to Ray

    # -- the driver's parts ----------------------------------------------------------------
    async def _open_devices(self) -> tuple[Any, dict[str, Any]]:
        """Connects to the cluster and starts one NodeWorker per instance, each placed by
        its role's resource (restarted by Ray on a node that offers it, should its node
        die); returns the model's config and no local runner."""
        import ray

        cfg = self.config
        if not ray.is_initialized():
            ray.init(address=cfg.ray_address, log_to_driver=False)
            self._connected = True
        self._uses_pool = POLICIES[cfg.scheduler.policy].uses_pool
        wanted = instances(cfg.prefill_devices, cfg.decode_devices, self._uses_pool)
        if self._owns_workers:
            self.workers = start_workers(cfg, self._uses_pool, self._worker_factory)
        elif missing := sorted(set(wanted) - set(self.workers)):
            raise ValueError(f"workers has no worker for instance(s) {', '.join(missing)}")
        self.workers = {name: self.workers[name] for name in wanted}
        try:
            configs = await asyncio.wait_for(asyncio.gather(
                *(w.model_config.remote() for w in self.workers.values())), START_TIMEOUT_S)
        except asyncio.TimeoutError:
            roles = sorted({resource for _, resource in wanted.values()})
            raise EngineError(f"the cluster at {cfg.ray_address} placed no worker within "
                              f"{START_TIMEOUT_S:g} s: does it offer the resources "
                              f"{', '.join(roles)} (ray start --resources)?") from None
        await self._locate()
        return configs[0], {}

    async def _locate(self) -> None:
        ids = await asyncio.gather(*(w.node_id.remote() for w in self.workers.values()))
        self.nodes = dict(zip(self.workers, ids))

    async def _open_kv(self, geometry: KVGeometry, runners: dict[str, Any],  # type: ignore[override]
                       uses_pool: bool) -> RayKVSpace:
        """The ledger of every store, and each worker's tensors for the stores it holds."""
        cfg = self.config
        stores = kv_stores(cfg.prefill_devices, cfg.decode_devices, cfg.cache,
                           geometry.blocks_in(cfg.cache.host_pool_bytes, "host_pool_gb"))
        held = holders(stores, len(cfg.prefill_devices), self._uses_pool)
        # a device per worker: stores of two workers never share a tensor (or a hand-over)
        layout = {name: (f"{dev}@{held.get(name, '-')}", blocks)
                  for name, (dev, blocks) in stores.items()}
        self._layouts = {w: {name: stores[name] for name, h in held.items() if h == w}
                         for w in self.workers}
        self._geometry = geometry
        await asyncio.gather(*(self._reopen(w) for w in self.workers))
        kv = RayKVSpace(layout, geometry.block_size, cfg.cache.share_kv_memory, held,
                        self.workers, self.transport)
        kv.on_lost = self._lost
        return kv

    async def _reopen(self, worker: str) -> None:
        """Gives `worker` (new, or restarted by Ray) its stores' tensors."""
        await self.workers[worker].open_stores.remote(
            self._layouts[worker], self._geometry, self.config.cache.share_kv_memory)
        if self.nodes:
            self.nodes[worker] = await self.workers[worker].node_id.remote()

    def _lost(self, worker: str, exc: BaseException) -> NodeLost:
        """`worker` stopped answering: its instance goes offline."""
        error = NodeLost(f"the node of {worker} is lost: {type(exc).__name__}: {exc}")
        for actor in self.ray_actors:
            if actor.name == worker:
                actor.go_offline(f"NodeLost: {error}")
        return error

    async def _probe(self, max_len: int) -> list[IterationRecord]:
        cfg = self.config
        return await self.workers["decode0"].probe.remote(  # type: ignore[no-any-return]
            "decode0", cfg.cache.num_decode_blocks, cfg.cache.block_size, max_len,
            cfg.scheduler.max_batch_size)

    def _driver(self) -> Callable[..., RayActor]:
        return partial(RayActor, self._context, reopen=self._reopen)

    def _close_devices(self) -> None:
        import ray

        if self._owns_workers:
            for worker in self.workers.values():
                ray.kill(worker, no_restart=True)
        self.workers.clear()
        if self._connected:
            ray.shutdown()

    @property
    def ray_actors(self) -> list[RayActor]:
        return self.actors  # type: ignore[return-value]

    # -- observability -----------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """The engine's report plus every instance's node: healthy while each is online."""
        report = super().health()
        nodes = {a.name: {"node_id": self.nodes.get(a.name), "online": a.offline is None,
                          "error": a.offline}
                 for a in self.ray_actors if a.name in self.workers}
        report["nodes"] = nodes
        report["healthy"] = report["healthy"] and all(n["online"] for n in nodes.values())
        return report

    def stats(self) -> dict[str, Any]:
        """The engine's stats plus, per instance, whether its node is online and the KV
        blocks in use in the stores its worker holds."""
        stats = super().stats()
        online = {a.name: a.offline is None for a in self.ray_actors}
        stats["nodes"] = {w: {"node_id": self.nodes.get(w), "online": online.get(w, False),
                              "kv_used": used}
                          for w, used in self._context.kv.used_by_worker().items()}  # type: ignore[attr-defined]
        return stats

    def call_overheads(self) -> dict[str, float]:
        """Mean seconds per forward that an instance's call to its worker took beyond the
        forward itself (the call, its arguments and results), by instance."""
        return {a.name: a.call_overhead / a.num_calls for a in self.ray_actors if a.num_calls}

    def blocks_by_node(self) -> dict[str, int]:
        """KV blocks in use on each Ray node, summed over the stores its workers hold."""
        out: dict[str, int] = {}
        for worker, used in self._context.kv.used_by_worker().items():  # type: ignore[attr-defined]
            node = self.nodes.get(worker, worker)
            out[node] = out.get(node, 0) + sum(used.values())
        return out
