"""AlignedServe: prefix-aware batching for LLM serving on raw PyTorch.

Public API: `Engine`, `LLM`, `EngineConfig`, `SamplingParams`, `RequestOutput`, `generate`.
Exports resolve lazily, so `import aserve.core` stays cheap and free of torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "Engine": "aserve.engine",
    "EngineConfig": "aserve.config",
    "ModelConfig": "aserve.config",
    "CacheConfig": "aserve.config",
    "SchedulerConfig": "aserve.config",
    "SamplingParams": "aserve.core",
    "RequestOutput": "aserve.core",
    "generate": "aserve.offline",
    "LLM": "aserve.offline",
}
__all__ = ["LLM", "CacheConfig", "Engine", "EngineConfig", "ModelConfig", "RequestOutput",
           "SamplingParams", "SchedulerConfig", "__version__", "generate"]

if TYPE_CHECKING:
    from aserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from aserve.core import RequestOutput, SamplingParams
    from aserve.engine import Engine
    from aserve.offline import LLM, generate


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
