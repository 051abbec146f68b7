"""The simulated cluster: its topology and capacities (`ClusterConfig`), sized from
hardware (`cluster_for`). Defaults mirror aserve.config's engine defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from aserve.config import EngineConfig
from scheduler import PolicyConfig, ceil_div
from sim.cost import ModelGeometry
from sim.hardware import Hardware

MEMORY_UTILIZATION = 0.9  # share of device / host memory the KV and weights may use
SCRATCH_SHARE = 0.25  # share of a prefill device's free memory kept as prefill scratch


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """Devices and KV capacities, as an EngineConfig names them (instances per entry)."""

    prefill_devices: tuple[str, ...] = ("cpu",)  # one prefill instance per entry
    decode_devices: tuple[str, ...] = ("cpu",)  # one decode instance per entry
    block_size: int = 16  # tokens per KV block
    num_decode_blocks: int = 2048  # per decode (or colocated) instance (blocks)
    num_prefill_blocks: int = 1024  # scratch per prefill instance (blocks)
    num_staging_blocks: int = 1024  # candidate buffer per decode instance (blocks)
    num_host_blocks: int = 8192  # host KV pool (blocks)
    max_prefill_tokens: int = 2048  # token budget of one prefill (or mixed) step
    max_batch_size: int = 256  # most sequences in one decode iteration
    min_requests: int = 8  # DFS: smallest batch that saturates the decode device
    leaf_width: int = 16  # quad-tree leaf range (tokens)
    batch_kv_fraction: float = 0.9  # share of decode KV a new batch may take
    starvation_threshold: float | None = 30.0  # seconds; None switches it off
    max_spread: float | None = 1.5  # aligned: the alignment bound (see PolicyConfig)
    drain_floor: float = 0.1  # aligned: see PolicyConfig

    def __post_init__(self) -> None:
        if not self.prefill_devices or not self.decode_devices:
            raise ValueError("prefill_devices and decode_devices must name >= 1 device each")
        for name in ("block_size", "num_decode_blocks", "num_prefill_blocks",
                     "num_host_blocks", "max_prefill_tokens", "max_batch_size",
                     "min_requests", "leaf_width"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} ({getattr(self, name)}) must be >= 1")
        if self.num_staging_blocks < 0:
            raise ValueError(f"num_staging_blocks ({self.num_staging_blocks}) must be >= 0")
        if not 0 < self.batch_kv_fraction <= 1:
            raise ValueError(f"batch_kv_fraction ({self.batch_kv_fraction}) must be in (0, 1]")

    @property
    def colocated_devices(self) -> tuple[str, ...]:
        """Devices of the `continuous` baseline: every distinct device, one instance each."""
        return tuple(dict.fromkeys((*self.prefill_devices, *self.decode_devices)))

    @classmethod
    def from_engine(cls, config: EngineConfig, num_host_blocks: int) -> ClusterConfig:
        """The cluster an engine config describes (its host pool, sized in bytes there, in
        blocks here)."""
        cache, sched = config.cache, config.scheduler
        return cls(prefill_devices=config.prefill_devices, decode_devices=config.decode_devices,
                   block_size=cache.block_size, num_decode_blocks=cache.num_decode_blocks,
                   num_prefill_blocks=cache.num_prefill_blocks,
                   num_staging_blocks=cache.num_staging_blocks, num_host_blocks=num_host_blocks,
                   max_prefill_tokens=sched.max_prefill_tokens,
                   max_batch_size=sched.max_batch_size, min_requests=sched.min_requests,
                   leaf_width=sched.leaf_width, batch_kv_fraction=sched.batch_kv_fraction,
                   starvation_threshold=sched.starvation_threshold,
                   max_spread=sched.max_spread, drain_floor=sched.drain_floor)

    def policy_config(self, max_len: int) -> PolicyConfig:
        return PolicyConfig.of(self, max_len)


def cluster_for(hardware: Hardware, geometry: ModelGeometry, num_prefill: int, num_decode: int,
                **overrides: object) -> ClusterConfig:
    """Separate devices sized from `hardware`: decode KV is the device memory left after the
    weights; a prefill device splits its rest between scratch and its staging buffers; the
    host pool is the host memory. Raises ValueError when the weights do not fit."""
    if num_prefill < 1 or num_decode < 1:
        raise ValueError(f"num_prefill ({num_prefill}) and num_decode ({num_decode}) "
                         "must be >= 1")
    block_size = int(overrides.get("block_size", 16))  # type: ignore[call-overload]
    block_bytes = block_size * geometry.kv_bytes_per_token(hardware.dtype_bytes)
    weights = geometry.num_params * hardware.dtype_bytes
    free = hardware.memory_bytes * MEMORY_UTILIZATION - weights
    if free < block_bytes:
        raise ValueError(f"{geometry.name} weights ({weights / 1e9:.1f} GB) leave no KV room "
                         f"on {hardware.name} ({hardware.memory_bytes / 1e9:.0f} GB)")
    free_blocks = int(free // block_bytes)
    scratch = max(1, int(free_blocks * SCRATCH_SHARE))
    buffers_per_device = ceil_div(num_decode, num_prefill)
    base = ClusterConfig(
        prefill_devices=tuple(f"gpu{i}" for i in range(num_prefill)),
        decode_devices=tuple(f"gpu{num_prefill + j}" for j in range(num_decode)),
        block_size=block_size, num_decode_blocks=free_blocks, num_prefill_blocks=scratch,
        num_staging_blocks=(free_blocks - scratch) // buffers_per_device,
        num_host_blocks=int(hardware.host_memory_bytes * MEMORY_UTILIZATION // block_bytes),
    )
    return replace(base, **overrides)  # type: ignore[arg-type]
