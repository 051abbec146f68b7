"""The simulated cluster: its topology and capacities (`ClusterConfig`), sized from
hardware (`cluster_for`). The policy, its budgets and knobs are the engine's own
`SchedulerConfig` (declared and validated once, there); capacities default to the engine's.
"""

from __future__ import annotations

import msgspec

from aserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from scheduler import ceil_div
from scheduler.cost_model import ModelGeometry
from scheduler.hardware import Hardware

MEMORY_UTILIZATION = 0.9  # share of device / host memory the KV and weights may use
SCRATCH_SHARE = 0.25  # share of a prefill device's free memory kept as prefill scratch


class ClusterConfig(CacheConfig, frozen=True, kw_only=True):
    """The engine's own configs on simulated devices: its CacheConfig (the KV stores'
    blocks, validated there; its host pool in GB is the engine's, the simulator's is
    `num_host_blocks`), its devices (one instance per entry; any names) and its
    SchedulerConfig."""

    prefill_devices: tuple[str, ...] = ("cpu",)  # one prefill instance per entry
    decode_devices: tuple[str, ...] = ("cpu",)  # one decode instance per entry
    num_host_blocks: int = 8192  # host KV pool (blocks; the engine sizes it in GiB)
    # the engine's ModelConfig.fuse_steps: steps of the instances sharing a device (and its
    # one KV tensor) that wait for it together run as one forward
    fuse_steps: bool = True
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.prefill_devices or not self.decode_devices:
            raise ValueError("prefill_devices and decode_devices must name >= 1 device each")
        if self.num_host_blocks < 1:
            raise ValueError(f"num_host_blocks ({self.num_host_blocks}) must be >= 1")

    @classmethod
    def create(cls, **kwargs: object) -> ClusterConfig:
        """From flat keywords, as `EngineConfig.create`: a SchedulerConfig field
        (`min_requests=`, `starvation_threshold=`…) sets that field of `scheduler`."""
        return cls().replace(**kwargs)

    def replace(self, **kwargs: object) -> ClusterConfig:
        """A copy with the given fields, flat scheduler keywords included (see `create`)."""
        knobs = {k: kwargs.pop(k) for k in list(kwargs) if k in SchedulerConfig.__struct_fields__}
        unknown = set(kwargs) - set(self.__struct_fields__)
        if unknown:
            raise ValueError(f"unknown cluster option(s): {', '.join(sorted(unknown))}")
        scheduler = msgspec.structs.replace(kwargs.pop("scheduler", self.scheduler), **knobs)  # type: ignore[arg-type,type-var]
        return msgspec.structs.replace(self, scheduler=scheduler, **kwargs)

    @property
    def colocated_devices(self) -> tuple[str, ...]:
        """Devices of the `continuous` baseline: every distinct device, one instance each."""
        return tuple(dict.fromkeys((*self.prefill_devices, *self.decode_devices)))

    @classmethod
    def from_engine(cls, config: EngineConfig, num_host_blocks: int) -> ClusterConfig:
        """The cluster an engine config describes (its host pool in blocks here)."""
        return cls(**msgspec.structs.asdict(config.cache), prefill_devices=config.prefill_devices,
                   decode_devices=config.decode_devices, num_host_blocks=num_host_blocks,
                   fuse_steps=config.model.fuse_steps, scheduler=config.scheduler)


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
    return base.replace(**overrides)
