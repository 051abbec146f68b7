"""AlignedServe: prefix-aware batching for LLM serving on raw PyTorch.

Public API: `Engine`, `LLM`, `EngineConfig`, `SamplingParams`, `RequestOutput`, `generate`.
Exports resolve lazily, so `import aserve.engine.sequence` stays cheap and free of torch.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING

_EXPORTS = {
    "Engine": "aserve.engine.engine",
    "EngineConfig": "aserve.engine.config",
    "ModelConfig": "aserve.engine.config",
    "CacheConfig": "aserve.engine.config",
    "SchedulerConfig": "aserve.engine.config",
    "SamplingParams": "aserve.engine.sequence",
    "RequestOutput": "aserve.engine.sequence",
    "generate": "aserve.entrypoints.offline",
    "LLM": "aserve.entrypoints.offline",
}
__all__ = ["LLM", "CacheConfig", "Engine", "EngineConfig", "ModelConfig", "RequestOutput",
           "SamplingParams", "SchedulerConfig", "__version__", "generate"]

if TYPE_CHECKING:
    from aserve.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from aserve.engine.engine import Engine
    from aserve.engine.sequence import RequestOutput, SamplingParams
    from aserve.entrypoints.offline import LLM, generate


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("aserve")
    except PackageNotFoundError:  # a checkout that was never installed
        return "0+unknown"


__version__ = _version()

# NOTE: torch's OpenMP threads sleep between parallel regions or spin for a while first;
# the runtime reads which from the environment once, when torch loads it. A decode step
# runs hundreds of short regions (every GEMM, norm and attention call), and waking a
# sleeping thread costs 35-100 us on the virtual machines measured (docs/results-cpu.md),
# so idle threads spin this many iterations first (GNU OpenMP, torch's own; Intel's when
# preloaded: KMP_BLOCKTIME ms). On a CPU shared with other busy processes spinning threads
# wait on each other: set OMP_WAIT_POLICY=PASSIVE there (`make test` does).
OPENMP_SPIN = {"GOMP_SPINCOUNT": "10000", "KMP_BLOCKTIME": "1"}


def _openmp_waits() -> str:
    """Spin before sleeping unless the environment already says how idle OpenMP threads
    wait (or torch, and with it the runtime, was loaded before aserve); how they wait."""
    told = {k: os.environ[k] for k in ("OMP_WAIT_POLICY", *OPENMP_SPIN) if k in os.environ}
    if told:
        return " ".join(f"{k}={v}" for k, v in told.items())
    if "torch" in sys.modules:
        return "the OpenMP runtime's defaults (torch was loaded before aserve)"
    os.environ.update(OPENMP_SPIN)
    return " ".join(f"{k}={v}" for k, v in OPENMP_SPIN.items())


OPENMP_WAITS = _openmp_waits()  # for the start-up log


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'aserve' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
