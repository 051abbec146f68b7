"""The x86 instruction sets this CPU offers to the kernels and matmuls: AVX2, AVX-512,
AVX-512 with bf16 dot products, AMX.

Which one a machine has decides the fast path: without AVX-512 BF16 or AMX, torch's bf16
matmuls widen element by element and the engine computes them in float32 from packed
weights (`models.opt.fit_matmuls_to`); with them oneDNN runs bf16 natively. The C kernels
(`models.cpu_kernels`) are compiled with `-march=native`, so they use whatever is listed
here. The engine logs `describe()` at start-up and `aserve bench` prints it with its tables.
"""

from __future__ import annotations

import os
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
NATIVE_BF16_LEVELS = ("AMX", "AVX-512-bf16")  # the levels with bf16 dot products
SHOWN_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_tile",
               "amx_bf16")  # the flags `describe` names when present


# ASERVE_MAX_ISA caps the level, to run (and test) a lower level's code paths on a better
# CPU: the flags above it are dropped from `cpu_flags`, and the C kernels are compiled for
# the generic x86-64 level that matches it (`march`). Pair it with torch's and oneDNN's own
# caps, which must be set before torch starts (docs/results-cpu.md):
#   ASERVE_MAX_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
CAPS = {  # level -> (flag prefixes it drops, the GCC -march that builds no more than it)
    "AVX2": (("avx512", "amx_"), "x86-64-v3"),
    "AVX-512": (("avx512_bf16", "avx512_fp16", "amx_"), "x86-64-v4"),
    "AVX-512-bf16": (("amx_",), None),  # the native build: AMX code runs only at "AMX"
}


def max_isa() -> str | None:
    """The level ASERVE_MAX_ISA caps this machine at (None: no cap).

    Raises:
        ValueError: for a value other than CAPS' levels.
    """
    cap = os.environ.get("ASERVE_MAX_ISA") or None
    if cap is not None and cap not in CAPS:
        raise ValueError(f"ASERVE_MAX_ISA ({cap!r}) must be one of {', '.join(CAPS)}")
    return cap


def cap_flags(flags: str, cap: str | None) -> str:
    """`flags` (a cpuinfo flags line) without the flags above the level `cap`."""
    if cap is None:
        return flags
    dropped = CAPS[cap][0]
    return " ".join(f for f in flags.split(" ") if not f.startswith(dropped))


def cpu_flags() -> str:
    """This CPU's feature flags line (Linux), or "" where /proc/cpuinfo is missing; under
    ASERVE_MAX_ISA, without the flags above that level."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    line = next((line for line in text.splitlines() if line.startswith(("flags", "Features"))),
                "")
    return cap_flags(line, max_isa())


@dataclass(frozen=True, slots=True)
class CpuIsa:
    """What this CPU offers, from its flags and from torch's own detection."""

    level: str  # the best of LEVELS this CPU has, or BASELINE
    flags: tuple[str, ...]  # the SHOWN_FLAGS it has
    torch_capability: str  # torch's vectorized kernels (`torch.backends.cpu`): AVX2, AVX512...
    native_bf16_matmul: bool  # oneDNN computes bf16 matmuls on bf16 dot products (AMX too)

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
    level = level_of(flags)
    # NOTE: oneDNN also takes bf16 matmuls on AVX-512 without bf16 instructions (Skylake-SP
    # to Ice Lake), widening them as it goes, about half as fast as the float32 path
    # (`models.opt.fit_matmuls_to`; docs/results-cpu.md), so only a level with bf16 dot
    # products counts as native.
    native = bool(level in NATIVE_BF16_LEVELS and torch.backends.mkldnn.is_available()
                  and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return CpuIsa(level, tuple(f for f in SHOWN_FLAGS if f in have),
                  torch.backends.cpu.get_cpu_capability(), native)


def describe() -> str:
    """`detect().describe()`."""
    return detect().describe()
