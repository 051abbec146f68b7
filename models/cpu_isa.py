"""The x86 instruction sets this CPU offers to the kernels and matmuls: AVX2, AVX-512,
AVX-512 with bf16 dot products, AMX.

Which one a machine has decides the fast path: without AVX-512 BF16 or AMX, torch's bf16
matmuls widen element by element and the engine computes them in float32 from packed
weights (`models.opt.fit_matmuls_to`); with them oneDNN runs bf16 natively. The C kernels
(`models.cpu_kernels`) are compiled with `-march=native`, so they use whatever is listed
here. The engine logs `describe()` at start-up and `aserve bench` prints it with its tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

# (level, the /proc/cpuinfo flags it needs), best first
LEVELS = (
    ("AMX", ("amx_tile", "amx_bf16", "avx512_bf16")),
    ("AVX-512-bf16", ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")),
    ("AVX-512", ("avx512f", "avx512bw", "avx512vl")),
    ("AVX2", ("avx2", "fma")),
)
BASELINE = "baseline"  # none of LEVELS (or not x86, or no /proc/cpuinfo)
SHOWN_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_tile",
               "amx_bf16")  # the flags `describe` names when present


def cpu_flags() -> str:
    """This CPU's feature flags line (Linux), or "" where /proc/cpuinfo is missing."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line for line in text.splitlines() if line.startswith(("flags", "Features"))),
                "")


@dataclass(frozen=True, slots=True)
class CpuIsa:
    """What this CPU offers, from its flags and from torch's own detection."""

    level: str  # the best of LEVELS this CPU has, or BASELINE
    flags: tuple[str, ...]  # the SHOWN_FLAGS it has
    torch_capability: str  # torch's vectorized kernels (`torch.backends.cpu`): AVX2, AVX512...
    native_bf16_matmul: bool  # oneDNN computes bf16 matmuls natively (AVX-512 BF16 or AMX)

    def describe(self) -> str:
        """One line, e.g. "AVX-512-bf16 (avx2 avx512f avx512_bf16 avx512_vnni; torch
        AVX512, bf16 matmuls native)"."""
        matmul = "native" if self.native_bf16_matmul else "in float32"
        return (f"{self.level} ({' '.join(self.flags) or 'no vector flags'}; torch "
                f"{self.torch_capability}, bf16 matmuls {matmul})")


def level_of(flags: str) -> str:
    """The best of LEVELS whose flags all appear in `flags` (a cpuinfo flags line)."""
    have = set(flags.split())
    return next((name for name, needs in LEVELS if have.issuperset(needs)), BASELINE)


@cache
def detect() -> CpuIsa:
    """This CPU's `CpuIsa` (read once per process)."""
    flags = cpu_flags()
    have = set(flags.split())
    native = bool(torch.backends.mkldnn.is_available()
                  and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return CpuIsa(level_of(flags), tuple(f for f in SHOWN_FLAGS if f in have),
                  torch.backends.cpu.get_cpu_capability(), native)


def describe() -> str:
    """`detect().describe()`."""
    return detect().describe()
