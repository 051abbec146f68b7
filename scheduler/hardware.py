"""Hardware descriptions for the simulator: one accelerator's memory, rates and links.

Nominal datasheet figures (dense FP16/BF16 tensor rate, HBM bandwidth); the achieved share
of them is a cost-model constant (`CostParams`), fitted by `scheduler.calibrate`.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9  # bytes per (decimal) gigabyte
TB = 1e12  # bytes per (decimal) terabyte
TFLOPS = 1e12  # floating-point operations per second


@dataclass(frozen=True, slots=True)
class Hardware:
    """One device of a homogeneous cluster, and the links around it."""

    name: str
    memory_bandwidth: float  # device memory bandwidth (bytes/s)
    matmul_rate: float  # dense matmul rate at the serving dtype (FLOP/s)
    num_sms: int  # parallel workers of an attention kernel (SMs; cores for a CPU)
    memory_bytes: float  # device memory (bytes)
    host_link_bandwidth: float  # host <-> device, per device and direction (bytes/s)
    device_link_bandwidth: float  # device <-> device, per device and direction (bytes/s)
    host_memory_bytes: float  # host memory of the whole machine (bytes)
    dtype_bytes: int = 2  # bytes per weight / KV element at the serving dtype

    def __post_init__(self) -> None:
        for name in ("memory_bandwidth", "matmul_rate", "memory_bytes", "host_link_bandwidth",
                     "device_link_bandwidth", "host_memory_bytes"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} ({value}) of hardware {self.name!r} must be > 0")
        if self.num_sms < 1:
            raise ValueError(f"num_sms ({self.num_sms}) of hardware {self.name!r} must be >= 1")
        if self.dtype_bytes < 1:
            raise ValueError(f"dtype_bytes ({self.dtype_bytes}) must be >= 1")

    @property
    def is_gpu(self) -> bool:
        return self.name != "cpu"


# NOTE: link figures are achievable rates, not signalling rates: PCIe 5.0 x16 moves about
# 55 GB/s per direction (4.0: about 25), NVLink 4 about 450 GB/s per direction (3: 300).
# Host memory is the paper's testbed (800 GB) for the GPUs.
HARDWARE: dict[str, Hardware] = {
    "h100": Hardware("h100", memory_bandwidth=3.35 * TB, matmul_rate=989 * TFLOPS, num_sms=132,
                     memory_bytes=80 * GB, host_link_bandwidth=55 * GB,
                     device_link_bandwidth=450 * GB, host_memory_bytes=800 * GB),
    "h200": Hardware("h200", memory_bandwidth=4.8 * TB, matmul_rate=989 * TFLOPS, num_sms=132,
                     memory_bytes=141 * GB, host_link_bandwidth=55 * GB,
                     device_link_bandwidth=450 * GB, host_memory_bytes=800 * GB),
    "a100": Hardware("a100", memory_bandwidth=2.039 * TB, matmul_rate=312 * TFLOPS,
                     num_sms=108, memory_bytes=80 * GB, host_link_bandwidth=25 * GB,
                     device_link_bandwidth=300 * GB, host_memory_bytes=800 * GB),
    # The 2-core development CPU (AVX-512), FP32: every "link" is a memcpy in DRAM.
    "cpu": Hardware("cpu", memory_bandwidth=12 * GB, matmul_rate=0.15 * TFLOPS, num_sms=2,
                    memory_bytes=16 * GB, host_link_bandwidth=6 * GB,
                    device_link_bandwidth=6 * GB, host_memory_bytes=16 * GB, dtype_bytes=4),
}


def get_hardware(name: str) -> Hardware:
    """The description named `name`. Raises ValueError if unknown."""
    hw = HARDWARE.get(name.lower())
    if hw is None:
        raise ValueError(f"hardware ({name!r}) must be one of {sorted(HARDWARE)}")
    return hw
