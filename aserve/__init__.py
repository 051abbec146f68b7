"""AlignedServe: prefix-aware batching for LLM serving on raw PyTorch.

Public API: `Engine`, `LLM`, `EngineConfig`, `SamplingParams`, `RequestOutput`, `generate`.
Exports resolve lazily, so `import aserve.engine.sequence` stays cheap and free of torch.
"""

from __future__ import annotations

import importlib
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


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'aserve' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
