"""The simulated cluster: its topology and capacities (`ClusterConfig`), and the state every
simulated actor shares (`SimContext`). Defaults mirror aserve.config's engine defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from bench.sim.cost import CostModel, ModelGeometry
from bench.sim.hardware import Hardware
from bench.sim.loop import Device, EventLoop, Link, Recorder, Store, Stores
from scheduler import Policy, PolicyConfig

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

    def policy_config(self, max_len: int) -> PolicyConfig:
        return PolicyConfig(min_requests=self.min_requests, leaf_width=self.leaf_width,
                            max_len=max_len, starvation_threshold=self.starvation_threshold,
                            max_spread=self.max_spread, drain_floor=self.drain_floor)


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
    buffers_per_device = -(-num_decode // num_prefill)
    base = ClusterConfig(
        prefill_devices=tuple(f"gpu{i}" for i in range(num_prefill)),
        decode_devices=tuple(f"gpu{num_prefill + j}" for j in range(num_decode)),
        block_size=block_size, num_decode_blocks=free_blocks, num_prefill_blocks=scratch,
        num_staging_blocks=(free_blocks - scratch) // buffers_per_device,
        num_host_blocks=int(hardware.host_memory_bytes * MEMORY_UTILIZATION // block_bytes),
    )
    return replace(base, **overrides)  # type: ignore[arg-type]


@dataclass
class SimContext:
    """What the simulated actors of one run share."""

    config: ClusterConfig
    cost: CostModel
    policy: Policy
    loop: EventLoop = field(default_factory=EventLoop)
    recorder: Recorder = field(default_factory=Recorder)
    stores: Stores = field(init=False)
    devices: dict[str, Device] = field(default_factory=dict)
    links: dict[str, Link] = field(default_factory=dict)
    policy_time: float = 0.0  # real seconds spent inside policy calls (not simulated)

    def __post_init__(self) -> None:
        self.stores = Stores(self.config.block_size)

    def device(self, name: str) -> Device:
        if name not in self.devices:
            self.devices[name] = Device(name)
        return self.devices[name]

    def link(self, name: str, bandwidth: float, device: str = "") -> Link:
        """The link `name`; on a CPU (`not hardware.is_gpu`) its copies occupy `device`'s
        compute timeline, as the engine runs CPU-to-CPU copies in the device's thread."""
        if name not in self.links:
            on = self.device(device) if device and not self.cost.hardware.is_gpu else None
            self.links[name] = Link(name, bandwidth, on)
        return self.links[name]

    def host_link(self, device: str, direction: str) -> Link:
        """`direction` is "h2d" or "d2h"; one PCIe link per device."""
        return self.link(f"{device}.{direction}", self.cost.hardware.host_link_bandwidth, device)

    def peer_link(self, src: str, dst: str) -> Link:
        """Device-to-device copies (NVLink); a plain memcpy when both are one device."""
        hw = self.cost.hardware
        bandwidth = hw.memory_bandwidth if src == dst else hw.device_link_bandwidth
        return self.link(f"{src}->{dst}", bandwidth, src)

    def copy(self, link: Link, start: float, num_blocks: int) -> float:
        """Moves `num_blocks` KV blocks over `link` from `start`; returns the arrival time."""
        return link.transfer(start, self.cost.kv_bytes(num_blocks, self.config.block_size))

    def store(self, name: str, kind: str, num_blocks: int) -> Store:
        return self.stores.add(name, kind, num_blocks)
